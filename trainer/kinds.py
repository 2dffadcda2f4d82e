"""The draft kinds, one place: cfg.kind -> its module. A new kind plugs in here, beside its export
(trainer/export.py) and its decoder (infer/draft.py, infer/dflash_draft.py)."""
from __future__ import annotations

from torch import nn

from trainer.dflash import DFlashHead
from trainer.head import Eagle3Head, HeadConfig

KINDS = {"eagle3": Eagle3Head, "dflash": DFlashHead}  # dflash: experimental (docs/ARCHITECTURE.md §14)


def build_head(cfg: HeadConfig) -> nn.Module:
    """The draft model of cfg.kind: an Eagle3Head or a DFlashHead."""
    return KINDS[cfg.kind](cfg)
