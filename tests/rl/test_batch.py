"""rl.batch: the SFT batch pads like the GRPO batch and truncates by the same rule (a row keeps its head)."""

import numpy as np

from rl import batch


def test_sft_batch_pads_rows_and_keeps_the_first_tokens():
    # (prompt 5 6, solution 7 8 9): 5 tokens into 4 keeps 5 6 7 8, the mask on 7 8; a short row is padded
    # with token 0 and mask 0; a missing row is all padding.
    examples = [([5, 6, 7, 8, 9], [0, 0, 1, 1, 1]), ([3, 4], [0, 1])]
    out = batch.sft_batch(examples, rows=3, length=4)
    assert sorted(out) == sorted(batch.SFT_KEYS)
    np.testing.assert_array_equal(out["tokens_BT"], [[5, 6, 7, 8], [3, 4, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out["mask_BT"], [[0, 0, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out["positions_BT"], [[0, 1, 2, 3]] * 3)
    assert out["tokens_BT"].dtype == np.int32 and out["mask_BT"].dtype == np.float32


def test_one_truncation_rule():
    assert batch.head([1, 2, 3], 2) == [1, 2] and batch.head([1], 4) == [1]
