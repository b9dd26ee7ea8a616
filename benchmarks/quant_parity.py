"""GPU correctness of the FP8 block-wise path (DeepSeek-V3/R1's checkpoint format) against HF
transformers reading the same checkpoint.

A random model of a real architecture is saved by transformers, its layer projections (and MoE
experts) rewritten in DeepSeek-V3's layout (e4m3 ``weight`` + 128 x 128 ``weight_scale_inv``),
and the same files are then run by

- HF transformers with ``FineGrainedFP8Config(dequantize=True)``: weights dequantized at load,
  activations in full precision, in fp32 (the reference) and in bf16 (its own rounding floor);
- deepbatch in bf16 on CUDA: the Triton W8A8 GEMMs (activations quantized per token and
  128-column group) and the FP8 grouped GEMM of the experts.

The difference between deepbatch and the fp32 reference is then the activation quantization plus
bf16 rounding; the bf16 reference shows how much of it is rounding alone. Reported: greedy tokens
identical per sequence (and the first divergence), next-token log-probability error over the top
20 tokens, and argmax agreement at the prompts' last positions.

    python benchmarks/quant_parity.py --model-config benchmarks/models/qwen3-0.6b.json

transformers derives the block size from the scale grid (rows / scale rows), which is the real
128 only where no block is partial: a config whose projections are not multiples of 128 (MLA's
576-row ``kv_a_proj_with_mqa``) is read wrongly by the reference, not by deepbatch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

import torch
from safetensors.torch import load_file, save_file

from deepbatch import LLM, SamplingParams
from deepbatch.layers.quantization.fp8 import quantize_fp8_blocks

BLOCK = (128, 128)
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": list(BLOCK)}


def build_checkpoint(config_path: str, num_layers: int | None, path: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(config_path) as f:
        raw = json.load(f)
    raw.pop("quantization_config", None)
    raw.pop("auto_map", None)
    if num_layers:
        raw["num_hidden_layers"] = num_layers
    cfg = AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tensors = {}
    for f in [f for f in os.listdir(path) if f.endswith(".safetensors")]:
        tensors.update(load_file(os.path.join(path, f)))
        os.remove(os.path.join(path, f))
    for index in [f for f in os.listdir(path) if f.endswith(".index.json")]:
        os.remove(os.path.join(path, index))
    out = {}
    for name, t in tensors.items():
        # Every decoder-layer projection, MLA's and the experts' (saved one expert at a time).
        if name.startswith("model.layers.") and name.endswith(("proj.weight", "proj_with_mqa.weight")) and t.dim() == 2:
            q, s = quantize_fp8_blocks(t.float(), BLOCK)
            out[name] = q
            out[name.removesuffix("weight") + "weight_scale_inv"] = s
        else:
            out[name] = t
    save_file(out, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    saved["quantization_config"] = FP8_BLOCK_CONFIG
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f)


def hf_reference(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, device_map="cuda",
        quantization_config=FineGrainedFP8Config(weight_block_size=BLOCK, dequantize=True)).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def hf_last_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt], device="cuda")).logits[0, -1].float(), -1).cpu()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", required=True)
    ap.add_argument("--num-layers", type=int, default=None, help="cut the model to this many layers")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    report: dict = {"model_config": args.model_config, "num_layers": args.num_layers}
    with tempfile.TemporaryDirectory() as path:
        build_checkpoint(args.model_config, args.num_layers, path)
        llm = LLM(path, dtype="bfloat16", device="cuda", max_model_len=2048, gpu_memory_utilization=0.5,
                  num_gpu_blocks_override=2048)
        vocab = llm.engine.hf_config.vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 600))] for _ in range(args.num_prompts)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                                           logprobs=20), use_tqdm=False)
        ours = [o.outputs[0].token_ids for o in outs]
        ours_top = [o.outputs[0].logprobs[0][1] for o in outs]  # {token: logprob} of the first output token
        report["deepbatch_weights"] = type(llm.engine.runner.model.model.layers[0].self_attn.o_proj.quant_method).__name__
        del llm
        torch.cuda.empty_cache()
        for name, dtype in (("hf-fp32", torch.float32), ("hf-bf16", torch.bfloat16)):
            model = hf_reference(path, dtype)
            ref = [hf_greedy(model, p, args.max_tokens) for p in prompts]
            ref_lp = [hf_last_logprobs(model, p) for p in prompts]
            same = sum(a == b for a, b in zip(ours, ref))
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ours, ref)]
            agree = sum(x == y for a, b in zip(ours, ref) for x, y in zip(a, b)) / sum(map(len, ref))
            err = max(max(abs(lp - float(r[t])) for t, lp in top.items()) for top, r in zip(ours_top, ref_lp))
            argmax = sum(o[0] == int(r.argmax()) for o, r in zip(ours, ref_lp)) / len(ref_lp)
            report[f"deepbatch vs {name}"] = {
                "sequences_identical": f"{same}/{len(ref)}", "first_divergence": first,
                "token_agreement_positionwise": round(agree, 4),
                "next_token_logprob_max_abs_err_top20": round(err, 4), "next_token_argmax_agreement": argmax}
            if name == "hf-fp32":
                fp32_lp, fp32_ids = ref_lp, ref
            else:
                report["hf-bf16 vs hf-fp32 (rounding floor)"] = {
                    "sequences_identical": f"{sum(a == b for a, b in zip(ref, fp32_ids))}/{len(ref)}",
                    "next_token_logprob_max_abs_err_top20": round(max(
                        float((a - b)[a.topk(20).indices].abs().max()) for a, b in zip(ref_lp, fp32_lp)), 4)}
            del model
            torch.cuda.empty_cache()
    for k, v in report.items():
        print(f"{k}: {v}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
