"""The portable forward (moe_forward_torch) against the float64 reference forward."""

import pytest
import torch

from common.inputs import make_problem
from common.metrics import sqnr_db
from common.problem import ClampLimits
from common.reference import reference_forward
from common.torch_backward import moe_forward_torch

CLAMP = ClampLimits(
    linear_clamp_upper_limit=1.0, linear_clamp_lower_limit=-1.0, non_linear_clamp_upper_limit=1.0
)


@pytest.mark.parametrize("dtype,min_db", [(torch.float32, 120.0), (torch.bfloat16, 40.0)])
def test_forward_matches_reference(dtype, min_db):
    p = make_problem(40, 64, 32, 5, 3, seed=4, bias=True, clamp_limits=CLAMP)
    args = (p.hidden_states_TH, p.w_gate_up_EH2I, p.w_down_EIH, p.plan)
    kw = {"b_gate_up_E2I": p.b_gate_up_E2I, "b_down_EH": p.b_down_EH, "clamp_limits": CLAMP}
    y_ref, act_ref = reference_forward(*args, **kw)
    y, act = moe_forward_torch(*args, compute_dtype=dtype, **kw)
    valid = p.plan.pair_valid_R
    assert act.dtype == dtype and y.dtype == torch.float32
    assert sqnr_db(y.double(), y_ref) >= min_db
    assert sqnr_db(act[valid].double(), act_ref[valid]) >= min_db
    assert torch.count_nonzero(act[~valid]) == 0  # padding pairs
    _, only_act = moe_forward_torch(*args, compute_dtype=dtype, with_output=False, **kw)
    assert torch.equal(only_act, act)
