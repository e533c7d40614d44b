"""The static half of decode's context split (triton_split.plan), on any machine."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tokenmill.kernels.triton_split import plan  # noqa: E402

CFG = {"max_partition": 512, "min_partition": 128, "programs_per_sm": 8, "max_splits": 64}


@pytest.mark.parametrize("num_seqs,max_ctx", [(1, 8192), (1, 100), (8, 131072), (64, 8192), (256, 8192), (512, 64)])
def test_plan_covers_the_table_and_fills_the_gpu(num_seqs: int, max_ctx: int) -> None:
    """The grid reaches the table's longest context at the longest partition. Contexts are cut into a power of two
    of partitions: enough for 8 programs a multiprocessor, unless the table's contexts or max_splits allow fewer;
    a batch that fills the GPU by itself is not cut for it."""
    num_parts, target_log2 = plan(num_seqs, 8, max_ctx, CFG, sms=132)
    target = 1 << target_log2
    assert num_parts * CFG["max_partition"] >= max_ctx and target <= num_parts
    cap = min(-(-max_ctx // CFG["min_partition"]), CFG["max_splits"])
    assert target <= cap
    assert num_seqs * 8 * target >= 8 * 132 or 2 * target > cap
    assert target == 1 or num_seqs * 8 * target // 2 < 8 * 132
