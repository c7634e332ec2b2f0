"""Helpers for the data path's tests (not tests): a real byte-level BPE tokenizer trained on the
fly with the `tokenizers` library on the shipped text (about 0.1 s), written as transformers
writes one (tokenizer.json, tokenizer_config.json with eos/pad tokens and a ChatML chat template
in Qwen2.5's style), a variant whose template marks the assistant's turns with
{% generation %}, a tiny Hugging Face Llama directory that ships that tokenizer, random chat
JSONL, and an independent ChatML renderer to check the engine's rendering against.

The fixtures are session-scoped, so the BPE is trained once per run: import them into a test
module (`from tests.data.tokenizer_fixture import bpe_dir, ...`)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from dataflow.data.shipped import shipped_text_path
from dataflow.models.config import ModelConfig

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = (EOS, IM_START, IM_END)
BPE_VOCAB = 480
"""256 byte symbols, the 3 special tokens and about 220 merges: fits the model's 512 rows."""
DEFAULT_SYSTEM = "You are a helpful assistant."

CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {%- if loop.first and message['role'] != 'system' %}\n"
    "        {{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")
"""Qwen2.5's ChatML (its tool branches left out): a default system turn when the conversation
has none, each turn `<|im_start|>{role}\\n{content}<|im_end|>\\n`, the generation prompt
`<|im_start|>assistant\\n`."""

CHATML_GENERATION_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {%- if loop.first and message['role'] != 'system' %}\n"
    "        {{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'assistant' %}\n"
    "        {{- '<|im_start|>assistant\\n' }}\n"
    "        {%- generation %}\n"
    "        {{- message['content'] + '<|im_end|>\\n' }}\n"
    "        {%- endgeneration %}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")
"""The same rendering, with {% generation %} around each assistant turn's content and end (as
transformers' return_assistant_tokens_mask templates mark it)."""

RAISING_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {%- if message['role'] == 'tool' %}\n"
    "        {{- raise_exception('this template has no tool turns') }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n")
"""A template that refuses a role ('tool') every template is taken to know."""

LLAMA_SHAPE = ModelConfig(name="tok-llama", vocab_size=512, model_dim=64, head_dim=16,
                          n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, rope_theta=1e4,
                          norm_eps=1e-6)


def train_bpe(out: Path, vocab_size: int = BPE_VOCAB) -> Path:
    """A byte-level BPE (GPT-2's pre-tokeniser and decoder) trained on the shipped text, saved
    as `out`/tokenizer.json; returns that file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(shipped_text_path())], trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def write_tokenizer_config(folder: Path, template: str | None = CHATML_TEMPLATE) -> Path:
    """tokenizer_config.json as transformers writes it for a ChatML model: eos and pad tokens,
    the chat template (left out when None)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": IM_END,
              "pad_token": EOS, "bos_token": None, "model_max_length": 32768,
              "added_tokens_decoder": {}}
    if template is not None:
        config["chat_template"] = template
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def tokenizer_copy(source: Path, folder: Path, template: str | None = CHATML_TEMPLATE) -> Path:
    """`folder` holding a copy of source's tokenizer.json and a tokenizer_config.json with
    `template`."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "tokenizer.json", folder / "tokenizer.json")
    write_tokenizer_config(folder, template)
    return folder


def write_hf_llama(path: Path, tokenizer_dir: Path, shape: ModelConfig = LLAMA_SHAPE) -> Path:
    """A Llama directory in transformers' layout (config.json, model.safetensors) of `shape`,
    with tokenizer_dir's tokenizer files copied in."""
    from dataflow.models.hf import save_pretrained
    from dataflow.models.init import init_model

    blocks = ((kind, layer, block) for kind, layer, _, block in init_model(shape, 0).blocks())
    save_pretrained(shape, blocks, path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


# -- chat records -----------------------------------------------------------------------------
_WORD = re.compile(r"[A-Za-z][A-Za-z’'-]*[,.;!?]?")


NON_ASCII_WORDS = ("naïve", "café", "日本語", "Ærø", "🙂", "e\u0301te")
"""Words whose characters are several bytes (and several byte-level tokens, some cut inside a
character), so offsets and masks are checked where characters and tokens disagree."""


def corpus_words() -> list[str]:
    """The shipped text's words (each starting with a letter) and NON_ASCII_WORDS, for random
    message contents."""
    words = set(_WORD.findall(shipped_text_path().read_text(encoding="utf-8")))
    return sorted(words | set(NON_ASCII_WORDS))


def random_sentence(rng, words: list[str], lo: int = 3, hi: int = 25) -> str:
    """lo..hi random words; sometimes a line break inside (before a word)."""
    n = int(rng.integers(lo, hi + 1))
    picked = [words[i] for i in rng.integers(0, len(words), n)]
    text = " ".join(picked)
    if n > 4 and rng.random() < 0.3:
        cut = text.find(" ", len(text) // 2)
        if cut > 0:
            text = text[:cut] + "\n" + text[cut + 1:]
    return text


def random_conversation(rng, words: list[str], *, turns: int | None = None, lo: int = 1,
                        hi: int = 25) -> list[dict]:
    """An optional system turn, then `turns` (1 or 2 when None) user/assistant exchanges of
    lo..hi words each."""
    turns = turns if turns is not None else int(rng.integers(1, 3))
    messages = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": random_sentence(rng, words, 2, 8)})
    for _ in range(turns):
        messages.append({"role": "user", "content": random_sentence(rng, words, lo, hi)})
        messages.append({"role": "assistant", "content": random_sentence(rng, words, lo, hi)})
    return messages


def write_chat_jsonl(path: Path, rng, n: int, *, field: str = "messages",
                     two_turns_every: int = 3, lo: int = 1, hi: int = 25) -> list[list[dict]]:
    """`n` chat records (every `two_turns_every`-th with two assistant turns, the rest with one;
    messages of lo..hi words) as JSONL at `path`; returns the conversations written."""
    words = corpus_words()
    convs = [random_conversation(rng, words, turns=2 if i % two_turns_every == 0 else 1,
                                 lo=lo, hi=hi)
             for i in range(n)]
    with open(path, "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps({field: c, "id": int(rng.integers(1 << 30))},
                               ensure_ascii=False) + "\n")
    return convs


def render_chatml(messages: list[dict], system: str = DEFAULT_SYSTEM
                  ) -> tuple[str, list[tuple[int, int]]]:
    """CHATML_TEMPLATE's rendering (with `system` as its default system turn) written out by
    hand, and the character spans of each assistant turn's `content<|im_end|>\\n` (what carries
    loss): the independent reference."""
    text, spans = "", []
    if messages[0]["role"] != "system":
        text += f"{IM_START}system\n{system}{IM_END}\n"
    for m in messages:
        text += f"{IM_START}{m['role']}\n"
        start = len(text)
        text += f"{m['content']}{IM_END}\n"
        if m["role"] == "assistant":
            spans.append((start, len(text)))
    return text, spans


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory) -> Path:
    """A folder with the trained tokenizer.json and a tokenizer_config.json whose template is
    CHATML_TEMPLATE."""
    folder = tmp_path_factory.mktemp("bpe")
    train_bpe(folder)
    write_tokenizer_config(folder)
    return folder


@pytest.fixture(scope="session")
def gen_bpe_dir(bpe_dir, tmp_path_factory) -> Path:
    """The same tokenizer with CHATML_GENERATION_TEMPLATE."""
    return tokenizer_copy(bpe_dir, tmp_path_factory.mktemp("bpe-gen"),
                          CHATML_GENERATION_TEMPLATE)


@pytest.fixture(scope="session")
def hf_llama_dir(bpe_dir, tmp_path_factory) -> Path:
    """A tiny Llama directory (vocab 512, width 64, 2 layers) shipping the BPE tokenizer."""
    return write_hf_llama(tmp_path_factory.mktemp("hf") / "tok-llama", bpe_dir)
