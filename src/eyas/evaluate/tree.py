"""A draft as a tree of proposed tokens hanging below the last committed token (the root).

A chain is the special case where every node has one child. Nodes are stored in creation
order, so a parent always comes before its children; index -1 in `parents` is the root.
In the verification pass the root is row 0 and node i is row i + 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)  # target-vocabulary ids
    parents: list[int] = field(default_factory=list)  # -1 = the root
    # Per node, the distribution it was sampled from over the target vocabulary [V], or None
    # when the proposer chose it deterministically (a point mass on the token).
    proposals: list[torch.Tensor | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, proposal: torch.Tensor | None = None) -> int:
        if not -1 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} does not exist yet")
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.proposals.append(proposal)
        return len(self.tokens) - 1

    @classmethod
    def chain(cls, tokens: list[int], proposals: list[torch.Tensor | None] | None = None) -> "DraftTree":
        tree = cls()
        for i, t in enumerate(tokens):
            tree.add(t, i - 1, proposals[i] if proposals else None)
        return tree

    def depths(self) -> list[int]:
        """Depth of each node: 1 for the root's children."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self) -> list[list[int]]:
        """Children of each verification row: row 0 is the root, row i + 1 is node i."""
        rows: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            rows[p + 1].append(i)
        return rows

    def ancestor_mask(self) -> torch.Tensor:
        """[M + 1, M + 1] bool over verification rows: row r may attend to column c iff c is
        r itself or one of its ancestors (the root is everyone's ancestor)."""
        n = len(self) + 1
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[0, 0] = True
        for i, p in enumerate(self.parents):
            mask[i + 1] = mask[p + 1]
            mask[i + 1, i + 1] = True
        return mask
