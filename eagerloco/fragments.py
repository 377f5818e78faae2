"""Split a model's parameters into the fragments Streaming DiLoCo synchronizes one at a time: groups of
transformer blocks, with every parameter outside them (embeddings, final norm, head) in fragment 0.
"""

from __future__ import annotations

from torch import nn

from eagerloco.config import ConfigError
from eagerloco.schedule import block_groups


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks in order: its ``blocks`` ModuleList, else the ModuleList with the most parameters
    (``transformer.h``, ``layers``); none: the model is one fragment."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    best: list[nn.Module] = []
    best_size = 0
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            size = sum(p.numel() for p in mod.parameters())
            if size > best_size:
                best, best_size = list(mod), size
    return best


def assign_fragments(
    model: nn.Module,
    fragments: int,
    pattern: str = "strided",
    blocks: list[nn.Module] | None = None,
) -> list[list[tuple[str, nn.Parameter]]]:
    """Named parameters of each fragment, in model order; every parameter in exactly one."""
    if blocks is None:
        blocks = find_blocks(model)
    if fragments > max(len(blocks), 1):
        raise ConfigError(
            f"--fragments ({fragments}) is larger than the model's number of blocks ({len(blocks)}); "
            f"choose 1..{max(len(blocks), 1)}"
        )
    owner: dict[int, int] = {}
    if blocks:
        for p, group in enumerate(block_groups(len(blocks), fragments, pattern)):
            for b in group:
                for param in blocks[b].parameters():
                    owner.setdefault(id(param), p)
    out: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(fragments)]
    for name, param in model.named_parameters():  # deduplicates tied parameters
        out[owner.get(id(param), 0)].append((name, param))
    for p, frag in enumerate(out):
        if not frag:
            raise ConfigError(f"fragment {p} holds no parameters; lower --fragments")
    return out


def trainable_fragments(
    frags: list[list[tuple[str, nn.Parameter]]],
) -> list[list[tuple[str, nn.Parameter]]]:
    """The fragments without their frozen parameters (no inner step changes them, so no exchange carries them);
    ConfigError when a fragment holds only frozen ones."""
    out = [[(name, p) for name, p in frag if p.requires_grad] for frag in frags]
    for i, (kept, frag) in enumerate(zip(out, frags, strict=True)):
        if not kept:
            raise ConfigError(
                f"fragment {i} holds only frozen parameters (requires_grad=False, e.g. {frag[0][0]}), which are "
                "never exchanged; use fewer fragments, another fragment_pattern, or unfreeze some of them"
            )
    return out
