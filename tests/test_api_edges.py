"""Edge cases a first user hit (docs/NEW_USER_REPORT.md): each must raise a clear error naming
the argument, or give the right value -- never a silent wrong result."""

import numpy as np
import pytest
import torch

from common import cli, dispatch
from common.inputs import make_problem
from common.mx import dequantize_nvfp4, mx_matmul, quantize_nvfp4
from common.problem import MoEBackwardProblem
from common.routing import plan_routing


@pytest.fixture(scope="module")
def plan():
    return plan_routing(torch.tensor([[1, 1, 3], [0, -1, 2]]), torch.rand(2, 3), 4)


def test_checkpoint_from_pairs_rejects_wrong_row_count(plan):
    with pytest.raises(ValueError, match=r"act_R2I must be \[R=6"):
        plan.blockwise(4).checkpoint_from_pairs(torch.empty(0, 2, 8))


def test_gather_pairs_rejects_wrong_row_count(plan):
    with pytest.raises(ValueError, match=r"per_pair_R has 2 rows.*R=6"):
        plan.grouped(4).gather_pairs(torch.rand(2, 8))


@pytest.mark.parametrize("num_tokens", [1, -1])
def test_scatter_add_rows_rejects_other_num_tokens(plan, num_tokens):
    g = plan.grouped(4)
    with pytest.raises(ValueError, match="num_tokens"):
        g.scatter_add_rows(torch.ones(g.tokens_sum, 3), num_tokens=num_tokens)


def test_pairs_from_slots_follows_pair_order(plan):
    act_TK1 = torch.arange(6.0).reshape(2, 3, 1)
    # pairs sorted by expert then token: (t1,e0)=slot 3, (t0,e1)=slot 0 or 1 (same pair),
    # (t1,e2)=slot 5, (t0,e3)=slot 2, then two padding pairs.
    got = plan.pairs_from_slots(act_TK1).flatten().tolist()
    assert got[0] == 3.0 and got[1] in (0.0, 1.0) and got[2:] == [5.0, 2.0, 0.0, 0.0]


def test_numpy_integers_accepted_and_dropped_slots_may_be_nan():
    ei = torch.tensor([[0, -1], [1, 0]])
    aff = torch.tensor([[0.5, float("nan")], [0.25, float("-inf")]])
    aff[1, 1] = 0.75  # routed slots must be finite; the dropped one (NaN) is ignored
    p = plan_routing(ei, aff, np.int64(2))
    lay = p.blockwise(np.int64(4))
    assert lay.block_size == 4 and torch.equal(
        p.affinity_dense_TE(), torch.tensor([[0.5, 0.0], [0.75, 0.25]])
    )
    with pytest.raises(ValueError, match="affinity must be finite on routed slots"):
        plan_routing(ei, torch.tensor([[float("nan"), 0.0], [0.1, 0.2]]), 2)


def test_problem_rejects_clamp_limits_dict():
    p = make_problem(8, 16, 8, 2, 1)
    bad = MoEBackwardProblem(
        p.hidden_states_TH, p.output_grad_TH, p.w_gate_up_EH2I, p.w_down_EIH, p.plan,
        p.act_checkpoint_R2I, clamp_limits={"linear_clamp_upper_limit": 1.0},
    )
    with pytest.raises(ValueError, match="clamp_limits must be a ClampLimits"):
        dispatch.run_backward(bad, "torch")


def test_env_auto_means_auto(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    assert dispatch.resolve_backend("auto", "cpu").name == "torch"
    assert dispatch.auto_backend_name("cpu") == "torch"


def test_cli_rejects_unusable_device_and_bad_skew(capsys):
    if not torch.cuda.is_available():
        assert cli.main(["run", "--model", "olmoe-1b-7b", "--tokens", "8", "--device", "cuda"]) == 2
        assert "--device" in capsys.readouterr().err
    assert cli.main(["run", "--model", "olmoe-1b-7b", "--tokens", "8", "--skew", "-1"]) == 2
    assert "--skew" in capsys.readouterr().err


def test_nki_sim_refuses_overwrite_scatter_with_top_k_above_one():
    p = make_problem(64, 128, 128, 4, 2)
    with pytest.raises(ValueError, match="is_tensor_update_accumulating=False"):
        dispatch.run_backward(p, "nki-sim", is_tensor_update_accumulating=False)


def test_nki_sim_validates_problem_before_the_zero_token_shortcut():
    p = make_problem(0, 128, 128, 4, 2)
    bad = MoEBackwardProblem(
        p.hidden_states_TH, p.output_grad_TH, p.w_gate_up_EH2I, p.w_down_EIH[:, :, :64], p.plan,
        p.act_checkpoint_R2I,
    )
    with pytest.raises(ValueError, match="w_down_EIH"):
        dispatch.run_backward(bad, "nki-sim")


def test_nki_kernel_rejects_ids_it_would_silently_skip():
    from nki_kernels import blockwise_mm_bwd_mxfp8
    from nki_kernels.backend import prepare_blockwise_args
    from nki_kernels.interp import simulate

    p = make_problem(64, 128, 128, 4, 2)
    args, kwargs, _ = prepare_blockwise_args(p)
    with pytest.raises(RuntimeError, match="interp.simulate"):
        blockwise_mm_bwd_mxfp8(*args, **kwargs)  # torch tensors, no launcher
    args = list(args)
    args[4] = args[4].clone()
    args[4][0] = 64 + 5
    with pytest.raises(ValueError, match=r"token_position_to_id values must lie in \[0, T=64\)"):
        simulate(blockwise_mm_bwd_mxfp8, lnc=2)(*args, **kwargs)
    args[4] = prepare_blockwise_args(p)[0][4]
    args[5] = torch.full_like(args[5], 4)
    with pytest.raises(ValueError, match=r"block_to_expert values must lie in \[0, E=4\)"):
        simulate(blockwise_mm_bwd_mxfp8, lnc=2)(*args, **kwargs)


@pytest.mark.parametrize("g", [-1.0, float("nan"), 0.0])
def test_dequantize_nvfp4_rejects_bad_global_scale(g):
    d, s, _ = quantize_nvfp4(torch.randn(4, 32))
    with pytest.raises(ValueError, match="global_scale"):
        dequantize_nvfp4(d, s, g)


def test_mx_matmul_rejects_numpy():
    with pytest.raises(ValueError, match="a_MK must be a torch.Tensor"):
        mx_matmul(np.ones((4, 32), np.float32), torch.ones(32, 4))
