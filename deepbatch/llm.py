"""Offline inference shaped like vLLM's ``LLM``: switch by changing the import.

    from deepbatch import LLM, SamplingParams
    llm = LLM()                                    # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

# Counts the threads torch's import started, before any op starts more (whether a tensor-parallel
# engine may fork its workers: ``executor/threads.py``).
import deepbatch.executor.threads  # noqa: F401
from tqdm.auto import tqdm

from deepbatch import envs
from deepbatch.config import EngineConfig, SpeculativeConfig
from deepbatch.engine_args import engine_config, llm_docstring
from deepbatch.engine.llm_engine import LLMEngine
from deepbatch.core.outputs import RequestOutput
from deepbatch.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepbatch.engine.offline_client import OfflineCoreClient


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        enable_prefix_caching: bool = True,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
        quantization: str | None = None,
        seed: int = 0,
        device: str | None = None,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        cuda_graph_mode: str = "full",
        mla_prefill: str = "expanded",
        fused_sampler: bool = True,
        async_scheduling: bool | None = None,
        num_gpu_blocks_override: int | None = None,
        random_weights: bool = False,
        scheduling_policy: str = "fcfs",
        priority_aging_s: float = 30.0,
        tenant_max_running: int | None = None,
        tenant_max_tokens_per_minute: int | None = None,
        static_batch_size: int | None = None,
        admission: str = "greedy",
        kv_watermark: float = 0.01,
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
        admission_batch_size: int | None = None,
        admission_max_delay_ms: float = 250.0,
        swap_space: float = 0.0,
        swap_prefill_tokens_per_s: float | None = None,
        swap_host_link_bytes_per_s: float | None = None,
        preemption_mode: str = "auto",
        tensor_parallel_size: int = 1,
        distributed_timeout_s: float = 60.0,
        speculative_config: dict | str | SpeculativeConfig | None = None,
    ):
        """Load the model and start the engine.

        The keywords are written out for IDEs and ``help(LLM)``; they are the engine arguments
        of deepbatch/config.py, and tests/test_engine_args.py holds this list to them (names and
        defaults). Each is described below."""
        # Every local here is a parameter: the builder gets them all, so none can be dropped.
        kwargs = dict(locals())
        del kwargs["self"]
        self._start(engine_config(**kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        """An LLM over an already-built engine config (the CLI builds one from its flags)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        """The engine in this process, or with ``DEEPBATCH_LLM_ENGINE_PROCESS=1`` the engine core in
        a process of its own (``engine/offline_client.py``); ``self.engine`` is then its frontend."""
        torch.manual_seed(config.model.seed)
        self._core: OfflineCoreClient | None = None
        if envs.DEEPBATCH_LLM_ENGINE_PROCESS:
            from deepbatch.engine.offline_client import OfflineCoreClient

            self._core = OfflineCoreClient(config)
            self.engine = self._core.frontend
        else:
            self.engine = LLMEngine(config)

    def shutdown(self) -> None:
        """Stop the engine core process, where there is one (it also stops when this process exits)."""
        if self._core is not None:
            self._core.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. Bad input raises
        before anything is queued."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        one = isinstance(sampling_params, SamplingParams)
        params = [sampling_params] * len(prompts) if one else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        return self._run([(p, sp) for p, sp in zip(prompts, params)], use_tqdm, priority)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.engine.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, items, use_tqdm: bool, priority) -> list[RequestOutput]:
        if self._core is not None:
            return self._run_in_core(items, use_tqdm, priority)
        engine = self.engine
        # Validate everything first so one bad prompt queues nothing.
        batches = [
            engine.make_requests(None, p, sp, priority[i] if priority else 0) for i, (p, sp) in enumerate(items)
        ]
        order = {}
        for i, requests in enumerate(batches):
            order[engine.enqueue(requests)] = i
        results: list[RequestOutput | None] = [None] * len(items)
        bar = tqdm(total=len(items), desc="Generating", unit="req", disable=not use_tqdm or len(items) < 2)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step(finished_only=True):
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            for pid in order:
                engine.abort_request(pid)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def _run_in_core(self, items, use_tqdm: bool, priority) -> list[RequestOutput]:
        core = self._core
        # Validate everything first so one bad prompt queues nothing.
        checked = [core.check(p, sp) for p, sp in items]
        order = {core.add(text, ids, sp, priority[i] if priority else 0): i
                 for i, (text, ids, sp) in enumerate(checked)}
        results: list[RequestOutput | None] = [None] * len(items)
        bar = tqdm(total=len(items), desc="Generating", unit="req", disable=not use_tqdm or len(items) < 2)
        try:
            while core.num_open:
                for out in core.step():
                    if out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            core.abort(order)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]


if LLM.__init__.__doc__ is not None:  # None under python -OO
    LLM.__init__.__doc__ = inspect.cleandoc(LLM.__init__.__doc__) + "\n" + llm_docstring()
