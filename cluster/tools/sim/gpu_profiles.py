"""Analytic H100-class and A100-class cost tables, derived from published
figures (not measured here). Writes the JSON profiles in profiles/:

    .venv/bin/python -m cluster.tools.sim.gpu_profiles

Model: Llama-3.1-8B-shaped (32 layers, hidden 4096, 8 KV heads x 128, bf16:
128 KiB of KV per token, 16 GB of weights) on one GPU.
- prefill step = overhead + (2 * params * new + 4 * layers * hidden * new *
  (cached + new / 2)) / (peak_flops * mfu_prefill)
- decode step = overhead + max(bytes_read / (hbm_bw * mbu), flops / (peak * mfu))
  with bytes_read = weights + context_tokens * kv_bytes_per_token.
Published peaks: H100 SXM 989 TFLOPS dense bf16, 3.35 TB/s HBM3, 400 Gb/s
NIC per GPU; A100 SXM 80GB 312 TFLOPS, 2.04 TB/s HBM2e, 200 Gb/s NIC.
Efficiencies (mfu 0.5 prefill, mbu 0.7 decode, 0.8 of line rate) are
assumptions in the range vLLM / SGLang reports show; the tables are labelled
"derived", never "measured".
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.tools.sim.cost_model import PROFILE_DIR, Table2D, TableCostModel, TransferCost

PREFILL_NEW = [1, 64, 256, 512, 1024, 2048, 4096, 8192, 16384]
PREFILL_CACHED = [0, 4096, 16384, 32768, 65536, 131072]
DECODE_BATCH = [1, 8, 32, 64, 128, 256]
DECODE_CONTEXT = [0, 65536, 262144, 524288, 1048576, 2097152]


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    nic_bytes_per_s: float
    step_overhead_s: float


@dataclass(frozen=True)
class Llm:
    name: str = "Llama-3.1-8B-shaped, bf16"
    params: float = 8.0e9
    layers: int = 32
    hidden: int = 4096
    kv_heads: int = 8
    head_dim: int = 128
    weight_bytes: float = 16.1e9

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


H100 = Gpu("H100 SXM 80GB", 989e12, 3.35e12, 80e9, 50e9, 0.004)
A100 = Gpu("A100 SXM 80GB", 312e12, 2.04e12, 80e9, 25e9, 0.005)
MFU_PREFILL, MFU_DECODE, MBU_DECODE, NIC_EFF = 0.5, 0.5, 0.7, 0.8


def derive(gpu: Gpu, llm: Llm = Llm(), name: str = "") -> TableCostModel:
    def prefill(new: float, cached: float) -> float:
        flops = 2 * llm.params * new + 4 * llm.layers * llm.hidden * new * (cached + new / 2)
        return gpu.step_overhead_s + flops / (gpu.peak_flops * MFU_PREFILL)

    def decode(batch: float, ctx: float) -> float:
        mem = (llm.weight_bytes + ctx * llm.kv_bytes_per_token) / (gpu.hbm_bytes_per_s * MBU_DECODE)
        flops = 2 * llm.params * batch + 4 * llm.layers * llm.hidden * ctx
        return gpu.step_overhead_s + max(mem, flops / (gpu.peak_flops * MFU_DECODE))

    kv_bytes = 0.9 * gpu.hbm_bytes - llm.weight_bytes - 4e9       # 90% utilisation, 4 GB activations
    return TableCostModel(
        name or gpu.name.split()[0].lower(),
        Table2D("prefill", PREFILL_NEW, PREFILL_CACHED, [[prefill(n, c) for c in PREFILL_CACHED]
                                                          for n in PREFILL_NEW]),
        Table2D("decode", DECODE_BATCH, DECODE_CONTEXT, [[decode(b, c) for c in DECODE_CONTEXT]
                                                          for b in DECODE_BATCH]),
        gpu.step_overhead_s,
        TransferCost(fixed_s=50e-6, per_descriptor_s=2e-6, bandwidth_bytes_per_s=gpu.nic_bytes_per_s * NIC_EFF),
        llm.kv_bytes_per_token, int(kv_bytes // llm.kv_bytes_per_token),
        {"source": "derived from published peak figures with assumed efficiencies (not measured)",
         "hardware": gpu.name, "model": llm.name,
         "description": f"1 GPU per node; mfu prefill {MFU_PREFILL}, mbu decode {MBU_DECODE}, "
                        f"NIC at {NIC_EFF} of line rate; see cluster/tools/sim/gpu_profiles.py",
         "scheduler": {"max_num_batched_tokens": 8192, "max_num_seqs": 256}})


def main() -> None:
    for gpu, name in ((H100, "h100"), (A100, "a100")):
        derive(gpu, name=name).save(PROFILE_DIR / f"{name}.json")
        print(f"wrote {PROFILE_DIR / name}.json")


if __name__ == "__main__":
    main()
