"""Rows of a tokenised corpus for training: records packed into rows of seqlen + 1 ids with their
labels (-100 where nothing is learnt) and document ids (attention never crosses a record), in a
seeded order reshuffled every epoch, with a JSON-able position for resume and a held-out tail
for validation. Never tokenises and never touches a device.

Packing: a text document fills the rest of a row and continues in the next (that row starts
with the token the last one ended on, so every token is a target once, as a token file's rows
overlap). A chat record is kept whole in one row: one that does not fit in what is left of a
row starts the next (the rest is padding, learnt nothing), and one longer than a row is cut to
the row (too_long='truncate', its ending lost) or left out (too_long='drop'), counted either
way. The first token of each record is never a target: nothing before it is its context.

The held-out tail: the last records of the corpus in file order, as few as hold eval_seqs rows
of tokens, never trained on; it exists only when asked for (the position records the split)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from dataflow.data.tokenise import Corpus
from dataflow.kernels.reference import IGNORE
from dataflow.models.errors import ConfigError

TOO_LONG = ("truncate", "drop")


@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """One step's rows as Engine.train_step takes them: tokens, labels and doc_ids, each
    (rows, seqlen + 1) int32."""

    tokens: np.ndarray
    labels: np.ndarray
    doc_ids: np.ndarray

    def step_args(self) -> tuple[tuple, dict]:
        """(args, kwargs) for Engine.train_step / eval_step."""
        return (self.tokens, self.labels), {"doc_ids": self.doc_ids}


class PackedCorpus:
    """Batches of a Corpus (see the module's docstring); iterate it for batches of
    `rows_per_batch` rows, or call next_batch(n)."""

    def __init__(self, corpus: Corpus, seqlen: int, *, eval_seqs: int = 0,
                 too_long: str = "truncate", seed: int = 0, pad_id: int = 0,
                 rows_per_batch: int = 1):
        if too_long not in TOO_LONG:
            raise ConfigError(f"too_long must be one of {', '.join(TOO_LONG)}, got {too_long!r}")
        self.corpus, self.seqlen, self.eval_seqs = corpus, seqlen, eval_seqs
        self.too_long, self.seed, self.pad_id = too_long, seed, pad_id
        self.rows_per_batch = rows_per_batch
        self.name = str(corpus.path)
        self._tokens, self._learn, starts, chat = corpus.arrays()
        self._starts = np.asarray(starts)
        self._chat = np.asarray(chat).astype(bool)
        lengths = np.diff(self._starts)
        held = self._held_out(lengths) if eval_seqs else 0
        n_train = lengths.size - held
        row = seqlen + 1
        train = np.arange(n_train)
        long_chat = self._chat[:n_train] & (lengths[:n_train] > row)
        self.too_long_records = int(long_chat.sum())
        keep = lengths[:n_train] > 0
        if too_long == "drop":
            keep &= ~long_chat
        silent_all = self._learns_nothing(lengths.size, row)
        silent = silent_all[:n_train]
        self.silent_records = int((silent & keep).sum())
        """Chat records left out because nothing of theirs inside a row is learnt (no assistant
        turn, or, cut to the row, none left): a batch of them would count no target."""
        keep &= ~silent
        self._train = train[keep]
        self._held = np.arange(n_train, lengths.size)[~silent_all[n_train:]]
        if eval_seqs and self._held.size == 0:
            raise ConfigError(
                f"{corpus.path}: the {held} held-out records at its end learn nothing inside a "
                f"row of {row} tokens (no assistant token), so validation would count nothing; "
                "use a longer seqlen, other data, or drop --eval-every")
        if self._train.size == 0:
            raise ConfigError(
                f"{corpus.path}: no record left to train on ({lengths.size} records, {held} "
                f"held out, {self.too_long_records} longer than seqlen + 1 = {row} with "
                f"too_long='{too_long}', {self.silent_records} with no assistant token inside "
                "a row); use more data, a longer seqlen or --too-long truncate")
        ident = [corpus.key, held, too_long, seed]
        self._fingerprint = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]
        self._pos = (0, 0, 0)  # epoch, index into the epoch's order, offset inside the record
        self._order, self._order_epoch = self._epoch_order(0), 0

    def _learns_nothing(self, n: int, row: int) -> np.ndarray:
        """Per record of the first n: a chat record none of whose targets inside its row (its
        tokens 1 .. row - 1: the first is never a target) is learnt. One pass over the learn
        flags of chat corpora; text records always learn."""
        out = np.zeros(n, bool)
        chat = np.flatnonzero(self._chat[:n])
        if chat.size == 0:
            return out
        first = self._starts[chat] + 1
        last = np.minimum(self._starts[chat] + row, self._starts[chat + 1])
        empty = first >= last
        out[chat[empty]] = True
        chat, first, last = chat[~empty], first[~empty], last[~empty]
        if chat.size:
            idx = np.stack([first, last], axis=1).reshape(-1)
            if idx[-1] == self._learn.size:  # reduceat's indices stay inside the array
                idx = idx[:-1]
            sums = np.add.reduceat(np.asarray(self._learn), idx, dtype=np.int64)[::2]
            out[chat] = sums[:chat.size] == 0
        return out

    def _held_out(self, lengths) -> int:
        need = self.eval_seqs * (self.seqlen + 1)
        total = np.cumsum(lengths[::-1])
        k = int(np.searchsorted(total, need)) + 1
        if k >= lengths.size:
            raise ConfigError(
                f"{self.corpus.path}: {int(lengths.sum()):,} tokens in {lengths.size} records "
                f"cannot hold out {self.eval_seqs} validation rows of {self.seqlen + 1} tokens "
                "and still train; use more data, a shorter seqlen or drop --eval-every")
        return k

    def _epoch_order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        return self._train[rng.permutation(self._train.size)]

    @property
    def train_tokens(self) -> int:
        return int(np.diff(self._starts)[self._train].sum())

    def __iter__(self):
        while True:
            yield self.next_batch(self.rows_per_batch)

    def next_batch(self, n_seqs: int) -> TokenBatch:
        rows = []
        for _ in range(n_seqs):
            row, self._pos = self._row(self._pos, self._train_order)
            rows.append(row)
        return _stack(rows)

    def eval_batch(self, n_seqs: int) -> TokenBatch | None:
        """The held-out rows, the same every call (None when nothing is held out)."""
        if not self.eval_seqs:
            return None
        pos, rows = (0, 0, 0), []
        for _ in range(min(n_seqs, self.eval_seqs)):
            row, pos = self._row(pos, lambda epoch: self._held)
            rows.append(row)
        return _stack(rows)

    def _train_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = self._epoch_order(epoch)
            self._order_epoch = epoch
        return self._order

    def _row(self, pos, order_of):
        """One row from position `pos` = (epoch, index, offset) and the position after it."""
        L = self.seqlen + 1
        tok = np.full(L, self.pad_id, np.int32)
        lab = np.full(L, IGNORE, np.int32)
        doc = np.zeros(L, np.int32)
        epoch, index, offset = pos
        col, d = 0, 0
        while col < L:
            order = order_of(epoch)
            r = int(order[index])
            a, b = int(self._starts[r]), int(self._starts[r + 1])
            if self._chat[r]:
                m = min(b - a, L)
                if col and m > L - col:
                    break  # kept whole: it starts the next row
                take, start, done = m, a, True
            else:
                start = a + offset
                take = min(b - start, L - col)
                done = start + take == b
            piece = np.asarray(self._tokens[start:start + take]).astype(np.int32)
            learn = np.asarray(self._learn[start:start + take]).astype(bool)
            tok[col:col + take] = piece
            lab[col:col + take] = np.where(learn, piece, IGNORE)
            if start == a:
                lab[col] = IGNORE  # a record's first token has no context: never a target
            doc[col:col + take] = d
            col, d = col + take, d + 1
            if done:
                index, offset = index + 1, 0
                if index == order.size:
                    epoch, index = epoch + 1, 0
            else:
                offset = start + take - 1 - a  # the next row starts on this row's last token
        doc[col:] = d  # padding: a document of its own that learns nothing
        return (tok, lab, doc), (epoch, index, offset)

    def _length_at(self, pos) -> int:
        """The length of the record at position (epoch, index, offset)."""
        r = int(self._train_order(pos[0])[pos[1]])
        return int(self._starts[r + 1] - self._starts[r])

    def state(self) -> dict:
        epoch, index, offset = self._pos
        return {"kind": "corpus", "dataset": self._fingerprint, "epoch": epoch,
                "record": index, "offset": offset}

    def load_state(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("kind") != "corpus":
            raise ConfigError(f"data position {state!r} is not for a tokenised corpus; resume "
                              "with the --data the checkpoint was trained on")
        if state.get("dataset") != self._fingerprint:
            raise ConfigError(f"data position is for corpus {state.get('dataset')!r}, but "
                              f"{self.name} with this tokenizer, held-out split and --too-long "
                              f"is {self._fingerprint!r}; resume with the same --data, "
                              "--tokenizer, --eval-every, --eval-seqs and --too-long as the "
                              "saved run")
        values = [state.get(k) for k in ("epoch", "record", "offset")]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values) \
                or values[1] >= self._train.size or values[2] >= self._length_at(values):
            raise ConfigError(f"data position {values} is not a position in {self.name}")
        self._pos = tuple(values)


def _stack(rows) -> TokenBatch:
    tok, lab, doc = (np.stack(parts) for parts in zip(*rows))
    return TokenBatch(tok, lab, doc)
