"""Is the target's argmax inside the draft vocabulary? An exact answer at a bfloat16 price.

A training label needs the target's argmax over its whole vocabulary V only to know whether it
lies among the N drafted ids (the draft vocabulary's logits are computed in float32 anyway, for
the distribution). On the first epoch that is a float32 product with the V - N other rows of the
output layer for every scored row: for SmolLM2 (V = 49,152, N = 8,192) 40,960 x 576
multiply-adds a row, the largest single cost of a first-epoch step. Later epochs reuse the
answer (TargetLabels).

OtherRowsScreen answers the same question from a bfloat16 product, where a CPU has fast
bfloat16 matmuls (AMX tiles: 3-7x float32's), and proves each answer with an error bound. For a
row h and another row w_j of the output layer, the float32 logit the old path computes is

    ref_j <= approx_j + 2^-8 |approx_j| + C ||h|| ||w_j||

approx_j: the bfloat16 product (float32 accumulation, rounded to bfloat16 on output: the 2^-8
term); C covers w_j rounded to bfloat16 (2^-9 relative per product), h rounded too unless it
already is bfloat16 (offline features are), and both products' float32 accumulation (n 2^-24 of
the sum of |products| each), with sum_i |h_i w_ji| <= ||h|| ||w_j|| (Cauchy-Schwarz). A row is
certain when that bound, over every other row, stays below its draft-vocabulary maximum v:
then no other token can win, whatever the rounding, and the answer is "in the draft vocabulary"
(what ~91-94% of rows are). The few output rows with the largest norms (2%) are multiplied in
float32 instead, so the rest share a tighter bound. A row the bound does not settle (7-9% on
SmolLM2's answers) is settled by its candidates, the other rows whose own bound reaches v,
computed in float64 with a margin for the float32 product's rounding; a row with a candidate
too close to call, or too many candidates, takes the float32 product as before. The labels are
the old path's, row for row; on a first epoch's ~150 scored rows the call takes ~28 ms against
~52 (Intel Xeon model 167, 2 threads).
"""

from __future__ import annotations

import torch
from torch import Tensor

UNIT_BF16 = 2.0**-9  # bfloat16's unit roundoff (8 significant bits)
UNIT_F32 = 2.0**-24
EXACT_SHARE = 0.02  # the output rows of the largest norms, multiplied in float32
ROW_MULTIPLE = 64  # oneDNN builds a kernel per new shape (~3.5 ms): a few shapes recur
MAX_CANDIDATES = 256  # a row with more candidates than this takes the float32 product


class OtherRowsScreen:
    """The output layer's rows outside the draft vocabulary, ready to screen hidden states."""

    def __init__(self, other: Tensor) -> None:
        """other: [V - N, H] float32, the output layer's rows outside the draft vocabulary (kept
        by reference: the candidates of a row are read from it)."""
        self.other = other
        self.norms = other.norm(dim=1)  # [V - N]
        order = self.norms.argsort(descending=True)
        count = min(other.shape[0], max(1, int(EXACT_SHARE * other.shape[0])))
        self.exact_index, self.low_index = order[:count], order[count:]  # into other's rows
        self.exact = other[self.exact_index].contiguous()  # [E, H] float32
        self.low = other[self.low_index].to(torch.bfloat16).contiguous()  # [L, H], L = V - N - E
        self.exact_norms = self.norms[self.exact_index]  # [E], largest first
        self.low_norms = self.norms[self.low_index]  # [L], largest first
        self.hidden_size = other.shape[1]

    def _relative(self, hidden_in_bf16: bool) -> float:
        """C of the module docstring: the bound per unit of ||h|| ||w_j||."""
        return 1.05 * (UNIT_BF16 * (1 if hidden_in_bf16 else 2) + UNIT_BF16**2 + 3 * self.hidden_size * UNIT_F32)

    def _products(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """(bfloat16 products with the low rows [c, L], float32 products with the exact rows [c, E])
        of hidden [c, H]."""
        rows = hidden.shape[0]
        padded = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE
        low_in = hidden.new_zeros(padded, self.hidden_size, dtype=torch.bfloat16)
        low_in[:rows] = hidden
        return (low_in @ self.low.T)[:rows], hidden @ self.exact.T

    def certain(self, hidden: Tensor, value: Tensor, hidden_in_bf16: bool) -> Tensor:
        """[c] bool: rows whose every other logit is certainly below value [c] (the row's maximum
        over the draft vocabulary, float32), so that the target's argmax is drafted.

        hidden: [c, H] float32; hidden_in_bf16: its values are exactly bfloat16 (no rounding)."""
        if hidden.shape[0] == 0:
            return torch.zeros(0, dtype=torch.bool, device=hidden.device)
        low, exact = self._products(hidden)
        return self._certain(hidden.norm(dim=1), value, hidden_in_bf16, low, exact)

    def _certain(self, norm: Tensor, value: Tensor, hidden_in_bf16: bool, low: Tensor, exact: Tensor
                 ) -> Tensor:
        """certain() from the products (norm [c]: each hidden row's)."""
        certain = torch.ones(norm.shape[0], dtype=torch.bool, device=norm.device)
        if low.shape[1]:
            top = low.amax(dim=1).float()  # [c]
            bound = top + 2 * UNIT_BF16 * top.abs() + self._relative(hidden_in_bf16) * norm * self.low_norms[0]
            certain &= bound < value
        if exact.shape[1]:
            # float32 here too, but another product than the old path's: its own rounding may
            # differ from that one's by a few units, so a margin for both
            margin = 4 * self.hidden_size * UNIT_F32 * norm * self.exact_norms[0]
            certain &= exact.amax(dim=1) + margin < value
        return certain

    def resolve(self, hidden: Tensor, value: Tensor, hidden_in_bf16: bool) -> tuple[Tensor, Tensor]:
        """(known [c] bool, drafted [c] bool): whether the target's argmax is drafted, for the rows
        where the screen can tell (known); the others need the float32 product with every row.

        A row that certain() does not settle is settled by its candidates, the other rows whose
        bound (with their own norm) reaches value: each candidate's logit is computed in float64,
        within a few float32 units of the float32 product's, so a candidate clearly above value
        means "not drafted", all clearly below means "drafted", and anything closer is unknown."""
        rows = hidden.shape[0]
        known = torch.zeros(rows, dtype=torch.bool, device=hidden.device)
        drafted = torch.zeros(rows, dtype=torch.bool, device=hidden.device)
        if rows == 0:
            return known, drafted
        low, exact = self._products(hidden)
        norms = hidden.norm(dim=1)  # [c]
        certain = self._certain(norms, value, hidden_in_bf16, low, exact)
        known |= certain
        drafted |= certain
        unsure = (~certain).nonzero().squeeze(1)  # [u]
        if unsure.numel() == 0:
            return known, drafted
        h, v = hidden[unsure], value[unsure]  # [u, H], [u]
        norm = norms[unsure, None]  # [u, 1]
        approx = low[unsure].float()  # [u, L]
        reach = (approx + 2 * UNIT_BF16 * approx.abs()
                 + self._relative(hidden_in_bf16) * norm * self.low_norms) >= v[:, None]  # [u, L]
        margin = 4 * self.hidden_size * UNIT_F32 * norm  # [u, 1]: times ||w_j||, float32 against float64
        reach_exact = exact[unsure] + margin * self.exact_norms >= v[:, None]  # [u, E]
        few = reach.sum(dim=1) + reach_exact.sum(dim=1) <= MAX_CANDIDATES  # [u] the others: unknown
        reach &= few[:, None]
        reach_exact &= few[:, None]
        low_row, low_column = reach.nonzero().unbind(1)
        exact_row, exact_column = reach_exact.nonzero().unbind(1)
        row = torch.cat([low_row, exact_row])  # [m] candidates: row in unsure, row of other
        index = torch.cat([self.low_index[low_column], self.exact_index[exact_column]])
        logit = (h[row].double() * self.other[index].double()).sum(dim=1)  # [m]
        slack = (margin[row, 0] * self.norms[index]).double()
        above = logit > v[row].double() + slack  # surely above the float32 value: not drafted
        unclear = ~above & (logit >= v[row].double() - slack)
        counts = torch.zeros(2, unsure.numel(), dtype=torch.int64, device=hidden.device)
        counts[0].index_add_(0, row, above.long())
        counts[1].index_add_(0, row, unclear.long())
        wins, doubt = counts[0] > 0, counts[1] > 0  # [u] each
        settled = few & (wins | ~doubt)  # [u]
        known[unsure[settled]] = True
        drafted[unsure[settled]] = ~wins[settled]
        return known, drafted
