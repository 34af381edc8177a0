"""KV cache groups: how a model whose layers attend differently (full and sliding-window, Gemma 3) shares one block
pool (pure Python).

Layers are cut into groups of equal size G, each group holding layers of one attention kind, the full-attention
groups first. Every group keeps its own block table per request, all drawn from one pool, and a block's storage is
G layer pages: slot s of a block is the page of the s-th layer of whichever group owns the block. So the runner
allocates G K/V tensors (one per slot), and layer l reads slot `slot_of[l]` through its group's block table.
A sliding-window group can hand back the blocks that fell out of its window (the memory win); group 0 keeps every
block, since the speculative draft reads its block table. With one kind of attention there is a single group of
all layers, which is exactly the plain layout.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroups:
    """The grouping of a model's decoder layers; `windows[g]` is group g's sliding window (None: full attention)."""

    layers: tuple[tuple[int, ...], ...]  # per group, its layer indices (slot s holds layers[g][s])
    windows: tuple[int | None, ...]  # per group
    num_slots: int  # G: layer pages per block

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @property
    def num_layers(self) -> int:
        return sum(len(g) for g in self.layers)

    def group_of(self, layer: int) -> int:
        """The group index of decoder layer `layer`."""
        return next(g for g, members in enumerate(self.layers) if layer in members)

    def slot_of(self, layer: int) -> int:
        """The slot (K/V tensor index) of decoder layer `layer`."""
        return self.layers[self.group_of(layer)].index(layer)

    @property
    def frees_out_of_window(self) -> bool:
        """Whether some group returns blocks that left its window (then block 0 is kept as the null block)."""
        return any(w is not None for w in self.windows[1:])


def group_layers(layer_windows: list[int | None]) -> KVCacheGroups:
    """Group layers by their sliding window (`layer_windows[l]`, None: full attention) into groups of the size of
    the smallest kind; full-attention groups first, then by window."""
    if not layer_windows:
        raise ValueError("a model needs at least one decoder layer")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1:
        ((window, layers),) = kinds.items()
        return KVCacheGroups((tuple(layers),), (window,), len(layers))
    size = min(len(v) for v in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    groups, windows = [], []
    for window in order:
        layers = kinds[window]
        for i in range(0, len(layers), size):
            groups.append(tuple(layers[i : i + size]))
            windows.append(window)
    return KVCacheGroups(tuple(groups), tuple(windows), size)
