"""The trainer's side of a language-model policy: token log-probs, entropy and a value head in torch.

The edge server samples action tokens with vLLM; the trainer needs, for the
same weights, the log-probability of those tokens under the distribution
vLLM sampled from (restricted to the action block, temperature 1), their
entropy, and a state value. :class:`LLMActorCritic` computes all three in one
teacher-forced forward pass of ``prompt + action tokens`` through the
Hugging Face model:

- the hidden state at position ``P - 1 + j`` (``P`` prompt tokens) gives the
  logits of action token ``j``; only the 256 rows of the output matrix that
  belong to the action block are multiplied, which equals masking every other
  token to ``-inf`` as the served engine does
  (``edgerl.edge_server.llm_logits``);
- the hidden state of the last prompt token feeds a linear value head (the
  usual choice for PPO on language models; it shares the trunk).

The served weights are the language model's own ``state_dict`` (the names
in its safetensors files); the value head stays with the trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from edgerl.models.llm import ObsActionCodec

LM_PREFIX = "lm."


class LLMActorCritic(nn.Module):
    """A causal LM policy over action tokens plus a value head on its last prompt state.

    Args:
        lm: a Hugging Face causal LM (``model`` trunk returning ``last_hidden_state``
            after the final norm, and an ``lm_head`` without bias).
        codec: the observation/action tokenisation the edge server uses.
    """

    def __init__(self, lm: Any, codec: ObsActionCodec) -> None:
        super().__init__()
        self.lm = lm
        self.codec = codec
        if getattr(lm.lm_head, "bias", None) is not None:
            raise ValueError("LLMActorCritic expects an lm_head without bias")
        self.value_head = nn.Linear(int(lm.config.hidden_size), 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def act_dim(self) -> int:
        return self.codec.act_dim

    def prompts(self, obs: np.ndarray) -> torch.Tensor:
        """int64 prompt token ids ``[n, P]`` for observations ``[n, *obs_shape]``."""
        return torch.from_numpy(self.codec.prompts(np.asarray(obs).reshape(len(obs), -1)))

    def action_tokens(self, actions: np.ndarray) -> torch.Tensor:
        """int64 action token ids ``[n, act_dim]`` of actions ``[n, act_dim]`` (bin centres)."""
        return torch.from_numpy(self.codec.encode(np.asarray(actions).reshape(len(actions), -1)))

    def _hidden(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.lm.model(input_ids=ids, use_cache=False)
        hidden: torch.Tensor = out.last_hidden_state
        return hidden

    def value(self, prompts: torch.Tensor) -> torch.Tensor:
        """State values ``[n]`` of prompt token ids ``[n, P]``."""
        value: torch.Tensor = self.value_head(self._hidden(prompts)[:, -1]).squeeze(-1)
        return value

    def forward(
        self, prompts: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-prob ``[n]`` of ``actions`` (token ids ``[n, A]``), entropy ``[n]`` and value ``[n]``.

        Log-prob and entropy are sums over the ``A`` action tokens, each under the
        distribution restricted to the action block.
        """
        p, a = prompts.shape[1], actions.shape[1]
        hidden = self._hidden(torch.cat([prompts, actions], dim=1))
        layout = self.codec.layout
        block = self.lm.lm_head.weight[layout.action_base : layout.action_base + layout.bins]
        log_p = functional.log_softmax(functional.linear(hidden[:, p - 1 : p - 1 + a], block), dim=-1)
        picked = torch.gather(log_p, 2, (actions - layout.action_base).unsqueeze(-1)).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        values = self.value_head(hidden[:, p - 1]).squeeze(-1)
        return picked.sum(1), entropy.sum(1), values

    def served_state(self) -> dict[str, torch.Tensor]:
        """The weights the edge server loads: the LM's ``state_dict`` (its safetensors names)."""
        state: dict[str, torch.Tensor] = self.lm.state_dict()
        return state


def served_weights(state: dict[str, Any]) -> dict[str, Any]:
    """The LM's weights out of an :class:`LLMActorCritic` ``state_dict`` (a checkpoint's ``policy``)."""
    return {k.removeprefix(LM_PREFIX): v for k, v in state.items() if k.startswith(LM_PREFIX)}


def load_llm_actor_critic(
    model_dir: str | Path,
    act_low: np.ndarray,
    act_high: np.ndarray,
    *,
    instruction: str = "",
    obs_clip: float = 5.0,
) -> LLMActorCritic:
    """The model in ``model_dir`` (local only, float32) with a zero value head.

    ``instruction`` and ``obs_clip`` must be those the edge server's backend uses.
    """
    from transformers import AutoModelForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise ValueError(f"model {path}: no config.json (models load from a local folder only)")
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    codec = ObsActionCodec(act_low, act_high, obs_clip=obs_clip, instruction=instruction)
    return LLMActorCritic(lm, codec)
