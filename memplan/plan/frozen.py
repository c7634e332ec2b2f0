"""Frozen blocks (issue 54, first step): which of the embedding, the head and the transformer
layers a plan trains no further. A frozen block keeps its weights (streamed or resident as
before) and gets no gradient buffer, no AdamW state, no gradient copy and no weight-gradient
GEMM; the input gradient still flows through a frozen layer to the trainable ones below it.
Parsed once at the CLI / Engine edge from the spelling of `parse_freeze`. Never imports array
libraries."""

from __future__ import annotations

import dataclasses

from dataflow.models.errors import ConfigError

SPELLING = "embed, head, layers:A-B, layers:N or layers:all, comma-separated"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Frozen:
    embed: bool = False
    """The token embedding table is frozen (its lookup still runs)."""
    head: bool = False
    """The final norm and lm_head are frozen (the loss and its input gradient still run)."""
    layers: tuple[int, ...] = ()
    """Indices of the frozen transformer layers, ascending, no repeats."""

    def __post_init__(self):
        if list(self.layers) != sorted(set(self.layers)) or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.layers):
            raise ConfigError(f"frozen layers must be ascending distinct non-negative layer "
                              f"indices, got {self.layers!r}; parse a spec with parse_freeze")

    @property
    def anything(self) -> bool:
        """Whether anything is frozen."""
        return self.embed or self.head or bool(self.layers)

    def __bool__(self) -> bool:
        """False when nothing is frozen, as an empty spec string is."""
        return self.anything

    def layer(self, i: int) -> bool:
        return i in self.layers

    def block(self, kind: str, layer: int | None = None) -> bool:
        """Whether block `kind` ('embed', 'head', 'layer' with its index) is frozen."""
        if kind == "layer":
            return layer in self.layers
        return self.embed if kind == "embed" else self.head

    def check(self, n_layers: int, where: str = "frozen") -> None:
        """Refuse layer indices beyond a model of `n_layers` layers."""
        bad = [i for i in self.layers if i >= n_layers]
        if bad:
            raise ConfigError(f"{where}: layers {bad} do not exist in a model of {n_layers} "
                              f"layers (0-{n_layers - 1}); freeze layers:0-{n_layers - 1} at most")

    def spec(self) -> str:
        """The canonical spelling (parse_freeze's input); '' when nothing is frozen."""
        parts = ["embed"] * self.embed + ["head"] * self.head
        runs: list[list[int]] = []
        for i in self.layers:
            if runs and runs[-1][1] == i - 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
        parts += [f"layers:{a}" if a == b else f"layers:{a}-{b}" for a, b in runs]
        return ",".join(parts)

    def describe(self, n_layers: int) -> str:
        """'embedding, head and 30 of 32 layers (0-29)' for explanations."""
        what = ["embedding"] * self.embed + ["head"] * self.head
        if self.layers:
            runs = self.spec().split(",")[len(what):]
            what.append(f"{len(self.layers)} of {n_layers} layers "
                        f"({', '.join(r.split(':')[1] for r in runs)})")
        if not what:
            return "nothing"
        return what[0] if len(what) == 1 else ", ".join(what[:-1]) + " and " + what[-1]


NOTHING_FROZEN = Frozen()


def _layer_index(text: str, n_layers: int, item: str) -> int:
    try:
        i = int(text)
    except ValueError:
        raise ConfigError(f"--freeze item '{item}': '{text}' is not a layer index; spell "
                          f"{SPELLING}") from None
    if not 0 <= i < n_layers:
        raise ConfigError(f"--freeze item '{item}': layer {i} is outside 0-{n_layers - 1} "
                          f"(the model has {n_layers} layers)")
    return i


def parse_freeze(text: str | None, n_layers: int) -> Frozen:
    """Frozen from a spec such as 'embed,head,layers:0-29' for a model of `n_layers` layers;
    None or '' freezes nothing. Raises ConfigError naming the bad item and the spelling."""
    if text is None or not text.strip():
        return NOTHING_FROZEN
    embed = head = False
    layers: set[int] = set()
    for raw in text.split(","):
        item = raw.strip()
        if item == "embed":
            embed = True
        elif item == "head":
            head = True
        elif item.startswith("layers:"):
            rng = item[len("layers:"):].strip()
            if rng == "all":
                layers.update(range(n_layers))
                continue
            lo, sep, hi = rng.partition("-")
            a = _layer_index(lo.strip(), n_layers, item)
            b = _layer_index(hi.strip(), n_layers, item) if sep else a
            if b < a:
                raise ConfigError(f"--freeze item '{item}': the range runs backwards; write "
                                  f"layers:{b}-{a}")
            layers.update(range(a, b + 1))
        else:
            raise ConfigError(f"--freeze item '{item}' is not understood; spell {SPELLING} "
                              "(e.g. embed,head,layers:0-29)")
    return Frozen(embed=embed, head=head, layers=tuple(sorted(layers)))


def as_frozen(value, n_layers: int) -> Frozen:
    """A Frozen from a Frozen, a spec string or None (the Engine's and make_plan's argument)."""
    if isinstance(value, Frozen):
        value.check(n_layers)
        return value
    if value is None or isinstance(value, str):
        return parse_freeze(value, n_layers)
    raise ConfigError(f"freeze must be a spec string ({SPELLING}) or a Frozen, got "
                      f"{type(value).__name__}")
