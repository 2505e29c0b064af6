"""The C++ decoder-layer stack (engine/model/layer_stack.py, csrc/decoder_layers.cpp): a step gives
bit for bit the hidden states and KV pool of the model's Python loop (panels for a few rows, the
packed weights for more), greedy tokens equal transformers', and the model keeps its loop where
the stack does not apply."""
from __future__ import annotations

import pytest
import torch

from engine.attention.kernels import cpu_kernel_available
from engine.model.layer_stack import LayerStack
from engine.model.panel_weights import MAX_ROWS
from tiny_models import hf_greedy, load_hf_model

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="the C++ kernels did not build here")


def _llm(path, **kw):
    from engine import LLM
    return LLM(str(path), num_kv_blocks=64, max_model_len=128, **{"panel_weights": "on", **kw})


class BothWays:
    """Wraps the model's hidden_states: every step runs the Python loop, then the stack, on the
    same inputs; records the step's rows and whether the two agreed bit for bit."""

    def __init__(self, model) -> None:
        self.model, self.stack = model, model.layer_stack
        self.inner = model.hidden_states
        self.compared: list[tuple[int, bool]] = []
        model.hidden_states = self

    def __call__(self, batch, kv_pool, on_layer=None):
        self.model.layer_stack = None
        loop = self.inner(batch, kv_pool, on_layer)
        pool_loop = kv_pool.clone()
        self.model.layer_stack = self.stack
        stacked = self.inner(batch, kv_pool, on_layer)
        self.compared.append((batch.input_ids.shape[0], torch.equal(loop, stacked) and torch.equal(pool_loop, kv_pool)))
        return stacked


@pytest.mark.parametrize("panels", ["on", "off"])
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])   # qkv bias, tied LM head
def test_stack_equals_the_python_loop_bit_for_bit_and_transformers_greedy(model, panels, request):
    from engine import SamplingParams

    path = request.getfixturevalue(model)
    llm = _llm(path, panel_weights=panels)
    stack = llm.engine.runner.model.layer_stack
    assert stack is not None and bool(stack.panels) == (panels == "on")
    both = BothWays(llm.engine.runner.model)
    prompts = [[5, 17, 2], [6, 17, 5, 9] + list(range(20, 26)), list(range(30, 47)), list(range(50, 71))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    # alone: a 3-token prefill (causal attention in the stack) and 1-row decodes; then the other
    # three: one 48-row prefill step (past the panels' rows: the packed weights), then 3-row decodes
    got = [list(r.outputs[0].token_ids) for r in llm.generate(prompts[:1], params)]
    got += [list(r.outputs[0].token_ids) for r in llm.generate(prompts[1:], params)]
    hf = load_hf_model(path)
    assert got == [hf_greedy(hf, p, 10) for p in prompts]
    assert both.compared and all(same for _, same in both.compared), both.compared
    assert {1, 3, 48} <= {rows for rows, _ in both.compared}


def test_stack_runs_every_step_unless_a_layer_callback_is_given(tiny_llama_dir, monkeypatch):
    from engine import SamplingParams

    llm = _llm(tiny_llama_dir)
    model = llm.engine.runner.model
    calls: list[int] = []
    run = LayerStack.run
    monkeypatch.setattr(LayerStack, "run", lambda self, h, rope, step: calls.append(h.shape[0]) or run(self, h, rope, step))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([list(range(3, 3 + MAX_ROWS + 1))], params)
    assert calls == [MAX_ROWS + 1, 1, 1, 1]                     # the prefill (packed weights), 3 decodes (panels)
    calls.clear()
    seen: list[int] = []
    inner = model.hidden_states
    monkeypatch.setattr(model, "hidden_states", lambda b, p, on_layer=None: inner(b, p, seen.append))
    llm.generate([[3, 4, 5]], params)
    assert calls == [] and seen                                 # with on_layer every step took the loop


def test_no_stack_on_torch_paged_plans_or_without_packed_weights(tiny_llama_dir, monkeypatch):
    from engine import SamplingParams

    llm = _llm(tiny_llama_dir, attention_backend="torch_paged")
    assert llm.engine.runner.model.layer_stack is not None      # built with the packed weights, but
    monkeypatch.setattr(LayerStack, "run", lambda *a: pytest.fail("the stack ran on a torch_paged plan"))
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3                # torch_paged's plans take the loop
    assert _llm(tiny_llama_dir, packed_weights=False).engine.runner.model.layer_stack is None


def test_no_stack_for_tensor_parallel_layers(tiny_llama_dir):
    from engine.attention import AttentionShape, get_attention_backend
    from engine.loader import load_model_source
    from engine.model.llama import LlamaForCausalLM

    cfg, sd = load_model_source(str(tiny_llama_dir))
    attention = get_attention_backend("cpu_paged", AttentionShape(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                                                                 cfg.head_dim, 16))
    with torch.inference_mode():
        model = LlamaForCausalLM(cfg, attention, device="cpu", dtype=torch.float32, reduce=lambda t: t.clone())
        model.load_hf_state_dict(sd)
        model.pack_weights(panels=True)
    assert model.layers[0].qkv_proj.packed is not None and model.layer_stack is None


def test_bad_stacks_say_what_is_wrong(tiny_llama_dir):
    plain = _llm(tiny_llama_dir, packed_weights=False)
    with pytest.raises(ValueError, match="pack_weights\\(\\) first"):
        LayerStack.of(list(plain.engine.runner.model.layers))
    with pytest.raises(ValueError, match="at least one layer"):
        LayerStack.of([])
    stack = _llm(tiny_llama_dir).engine.runner.model.layer_stack
    pool = torch.zeros(4, 2, 2, 2, 16, 16)
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="2 norms, 4 packed weights and 4 output sizes a layer"):
        torch.ops.pdserve.decoder_layers(torch.zeros(1, 64), list(stack.norms[:1]), [], list(stack.packed[:4]),
                                         [None], [1, 2, 3, 4], MAX_ROWS, torch.zeros(1, 16), torch.zeros(1, 16),
                                         one, pool, one.view(1, 1), torch.tensor([0, 1]), one + 1, 0.25, 4, 1e-5,
                                         1 << 18)
