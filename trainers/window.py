"""`OpenWindow`: the prefix groups of one accumulation window that still wait for their Phase C.

The trainer holds one and hands it to the helpers that open groups (`sequence_parallel.logps`), so that no helper
writes the trainer's own attributes; ending the window is replacing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_prefixflow.core.scheduler import GroupSession
from hf_prefixflow.distributed import placement


@dataclass
class OpenWindow:
    """The open prefix groups of the current accumulation window.

    Attributes:
        session: the window's `GroupSession`, started with its first group; None while none is open.
        open_groups: the groups open on this process, by group key (under SP: `(rank, key)`).
        splits: the groups split across processes (`placement.open_split`), by key, in the order they opened.
    """

    session: GroupSession | None = None
    open_groups: dict[tuple, object] = field(default_factory=dict)
    splits: dict[tuple, placement.SplitGroup] = field(default_factory=dict)

    def started(self, model: torch.nn.Module) -> GroupSession:
        """The window's session, started on first use."""
        if self.session is None:
            self.session = GroupSession(model).start()
        return self.session
