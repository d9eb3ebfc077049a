"""A language-model policy's vocabulary, its observation/action codecs, and a tiny local model.

Observations and actions travel as tokens (the OpenVLA/RT-2 scheme):

- each observation entry is clipped to ``[-obs_clip, obs_clip]`` and cut into
  ``bins`` uniform bins, one token per entry (``<o0>`` ... ``<o255>``);
- each action dimension is one token of a reserved block (``<a0>`` ...
  ``<a255>``), bin ``k`` decoding to the centre of the k-th of ``bins``
  uniform bins over the action range;
- an optional text instruction goes first, one token per character.

:func:`build_tiny_llm` writes a small random Llama (2 layers, head dimension
64) with this vocabulary's tokenizer into a folder, so tests and demos need
no model hub. Only ``numpy`` is needed to import this module; building a
model needs ``transformers`` and ``tokenizers`` (the ``llm`` extra).
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPECIAL = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = string.printable[:95]  # digits, letters, punctuation, space
BINS = 256


@dataclass(frozen=True)
class TokenLayout:
    """Where each kind of token sits in the vocabulary."""

    bins: int = BINS

    @property
    def obs_base(self) -> int:
        return len(SPECIAL)

    @property
    def char_base(self) -> int:
        return self.obs_base + self.bins

    @property
    def action_base(self) -> int:
        return self.char_base + len(CHARS)

    @property
    def vocab_size(self) -> int:
        used = self.action_base + self.bins
        return (used + 63) // 64 * 64  # round up: friendlier matrix shapes

    @property
    def bos(self) -> int:
        return SPECIAL.index("<bos>")

    def tokens(self) -> list[str]:
        names = [*SPECIAL, *(f"<o{i}>" for i in range(self.bins)), *CHARS]
        names += [f"<a{i}>" for i in range(self.bins)]
        names += [f"<unused{i}>" for i in range(self.vocab_size - len(names))]
        return names

    def action_token_ids(self) -> list[int]:
        return list(range(self.action_base, self.action_base + self.bins))


class ObsActionCodec:
    """Observations to prompt tokens, action tokens to actions (and back), for one env's spaces.

    Args:
        act_low, act_high: action bounds per dimension (finite).
        obs_clip: observations are clipped to ``[-obs_clip, obs_clip]`` before binning.
        instruction: text put before the observation tokens of every prompt.
    """

    def __init__(
        self,
        act_low: np.ndarray,
        act_high: np.ndarray,
        *,
        obs_clip: float = 5.0,
        instruction: str = "",
        layout: TokenLayout | None = None,
    ) -> None:
        self.layout = layout or TokenLayout()
        self.act_low = np.asarray(act_low, np.float32).ravel()
        self.act_high = np.asarray(act_high, np.float32).ravel()
        if not (np.all(np.isfinite(self.act_low)) and np.all(np.isfinite(self.act_high))):
            raise ValueError("an LLM policy needs finite action bounds")
        if not 0 < obs_clip < math.inf:
            raise ValueError(f"obs_clip must be a finite number > 0, got {obs_clip}")
        bad = sorted({c for c in instruction if c not in CHARS})
        if bad:
            raise ValueError(f"instruction: characters outside the vocabulary: {bad}")
        self.obs_clip = obs_clip
        self.prefix = [self.layout.bos] + [self.layout.char_base + CHARS.index(c) for c in instruction]

    @property
    def act_dim(self) -> int:
        return int(self.act_low.size)

    def prompts(self, obs: np.ndarray) -> np.ndarray:
        """int64 ``[n, len(prefix) + obs_dim]`` prompt token ids for observations ``[n, obs_dim]``."""
        bins = self.layout.bins
        x = np.clip(np.asarray(obs, np.float64), -self.obs_clip, self.obs_clip)
        k = np.minimum((x + self.obs_clip) / (2 * self.obs_clip) * bins, bins - 1).astype(np.int64)
        prefix = np.broadcast_to(np.asarray(self.prefix, np.int64), (len(k), len(self.prefix)))
        return np.concatenate([prefix, self.layout.obs_base + k], axis=1)

    def decode(self, token_ids: np.ndarray) -> np.ndarray:
        """float32 actions ``[n, act_dim]`` (bin centres) from action token ids ``[n, act_dim]``.

        Raises:
            ValueError: a token is not an action token.
        """
        k = np.asarray(token_ids, np.int64) - self.layout.action_base
        if np.any((k < 0) | (k >= self.layout.bins)):
            raise ValueError("decode: token outside the action block")
        width = (self.act_high - self.act_low) / self.layout.bins
        return (self.act_low + (k + 0.5) * width).astype(np.float32)

    def encode(self, actions: np.ndarray) -> np.ndarray:
        """Action token ids ``[n, act_dim]`` of the bins holding ``actions`` (the inverse of decode)."""
        a = np.asarray(actions, np.float64)
        rel = (a - self.act_low) / (self.act_high - self.act_low)
        k = np.clip(np.floor(rel * self.layout.bins), 0, self.layout.bins - 1).astype(np.int64)
        ids: np.ndarray = self.layout.action_base + k
        return ids


def tiny_llm(seed: int = 0) -> Path:
    """The small local model for demos and benchmarks, built once per seed under the temp folder."""
    import tempfile

    path = Path(tempfile.gettempdir()) / f"edgerl-tiny-llm-s{seed}"
    if not (path / "config.json").exists():
        build_tiny_llm(path, seed=seed)
    return path


def build_tiny_llm(out: str | Path, *, seed: int = 0, layers: int = 2, hidden: int = 128) -> Path:
    """Write a random Llama (``layers`` layers, head dimension 64) and its tokenizer into ``out``.

    Returns:
        The folder, loadable by ``transformers`` and vLLM without network access.
    """
    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if hidden % 64:
        raise ValueError(f"hidden must be a multiple of the head dimension 64, got {hidden}")
    layout = TokenLayout()
    vocab = {tok: i for i, tok in enumerate(layout.tokens())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<[a-z]+\d*>|."), behavior="isolated")
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    config = LlamaConfig(
        vocab_size=layout.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        head_dim=64,
        max_position_embeddings=512,
        bos_token_id=layout.bos,
        eos_token_id=SPECIAL.index("<eos>"),
        pad_token_id=SPECIAL.index("<pad>"),
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return path
