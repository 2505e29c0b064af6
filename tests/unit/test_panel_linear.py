"""The small-batch linear kernel on 16-output panels gives F.linear's results for any shape,
the RMSNorm kernel gives F.rms_norm's, and the engine decides when to keep the panels."""
import pytest
import torch
import torch.nn.functional as F

from engine.attention.kernels import cpu_kernel_available
from engine.config import EngineConfig
from engine.model.layers import FusedLinear, RMSNorm
from engine.model.panel_weights import panel_linear, panels_on_huge_pages, resolve_panel_weights, to_panels

needs_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason="the C++ kernels did not build here")


def test_panel_layout_and_padding():
    w = torch.arange(37 * 5, dtype=torch.float32).view(37, 5)
    p = to_panels(w)
    assert p.shape == (3, 5, 16)
    for o in range(37):
        assert torch.equal(p[o // 16, :, o % 16], w[o])
    assert torch.count_nonzero(p[2, :, 37 - 32:]) == 0        # the padded outputs are zero


def test_panels_share_one_buffer_and_hold_each_weight():
    ws = [torch.randn(40, 24), torch.randn(16, 8), torch.randn(3, 24)]
    ps = panels_on_huge_pages(ws)
    base = ps[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in ps)
    for w, p in zip(ws, ps):
        assert torch.equal(p, to_panels(w))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("n,k", [(16, 8), (40, 37), (1000, 576), (3, 1)])
def test_panel_linear_matches_f_linear(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    want = F.linear(x.double(), w.double(), b.double()).float()
    with torch.inference_mode():
        got = panel_linear(x, to_panels(w), b, n)
        no_bias = panel_linear(x, to_panels(w), None, n)
    assert got.shape == (rows, n) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5)
    torch.testing.assert_close(no_bias + b, want, rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_kernel
def test_panel_linear_rejects_bad_inputs():
    w = torch.randn(32, 8)
    with pytest.raises(RuntimeError, match="float32"):
        panel_linear(torch.randn(1, 8, dtype=torch.float64), to_panels(w), None, 32)
    with pytest.raises(RuntimeError, match="K = x.size"):
        panel_linear(torch.randn(1, 9), to_panels(w), None, 32)
    with pytest.raises(RuntimeError, match="number of panels"):
        panel_linear(torch.randn(1, 8), to_panels(w), None, 33)


@needs_kernel
def test_fused_linear_reads_panels_for_a_few_rows_only():
    lin = FusedLinear(24, 40, bias=True)
    w = torch.randn(40, 24)
    lin.load_parts([w], [torch.randn(40)])
    x = torch.randn(12, 24)
    want = lin(x)
    lin.add_panels(panels_on_huge_pages([lin.weight.data])[0])
    lin.pack()
    with torch.inference_mode():
        for rows in (1, 4, 12):                     # panels, panels, oneDNN
            torch.testing.assert_close(lin(x[:rows]), want[:rows], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not hold"):
        lin.add_panels(to_panels(torch.randn(40, 23)))
    lin.load_parts([w], [torch.randn(40)])
    assert lin.panels is None and lin.packed is None


@needs_kernel
@pytest.mark.parametrize("rows,h", [(1, 576), (3, 37), (200, 64), (0, 8)])
def test_rms_norm_kernel_matches_f_rms_norm(rows, h):
    norm = RMSNorm(h, 1e-5)
    norm.weight.data = torch.randn(h)
    x = torch.randn(rows, h) * 3
    with torch.inference_mode():
        got = norm(x)
    torch.testing.assert_close(got, F.rms_norm(x, (h,), norm.weight, 1e-5), rtol=2e-6, atol=2e-6)


def test_resolve_panel_weights():
    assert resolve_panel_weights("on", 10**12) and not resolve_panel_weights("off", 1)
    assert resolve_panel_weights("auto", 1 << 30, memory_bytes=8 << 30)
    assert not resolve_panel_weights("auto", (1 << 30) + 1, memory_bytes=8 << 30)
    assert not resolve_panel_weights("auto", 1, memory_bytes=0)      # memory unknown: off
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        resolve_panel_weights("yes", 1)
    with pytest.raises(ValueError, match="panel_weights"):
        EngineConfig(model="m", panel_weights="always")


@needs_kernel
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])   # qkv bias, tied LM head
def test_engine_greedy_tokens_same_with_and_without_panels(model, request):
    from engine import LLM, SamplingParams

    path = str(request.getfixturevalue(model))
    prompts = [[5 + i, 17, 3 * i + 2, 9] for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {}
    for mode in ("on", "off"):
        llm = LLM(path, num_kv_blocks=64, max_model_len=128, panel_weights=mode)
        model_ = llm.engine.runner.model
        assert (model_.layers[0].qkv_proj.panels is not None) == (mode == "on")
        assert (model_.lm_head_panels is not None) == (mode == "on")
        single = [list(r.outputs[0].token_ids) for p in prompts for r in llm.generate([p], params)]
        batched = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params)]
        assert single == batched
        runs[mode] = single
    assert runs["on"] == runs["off"]


def test_process_memory_is_the_container_limit_where_lower(tmp_path):
    from engine.model.panel_weights import process_memory_bytes

    machine = process_memory_bytes(())
    assert machine > 0
    v2, v1 = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    v2.write_text("max\n")                      # cgroup v2, unlimited
    assert process_memory_bytes((str(v2),)) == machine
    v1.write_text(f"{4 << 30}\n")               # a 4 GiB pod
    assert process_memory_bytes((str(v2), str(v1))) == min(machine, 4 << 30)
    v1.write_text(f"{machine * 4}\n")           # a limit above the machine's memory: the machine's
    assert process_memory_bytes((str(v1),)) == machine
    assert process_memory_bytes((str(tmp_path / "absent"),)) == machine
