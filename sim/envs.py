"""Seeded, vectorised gymnasium MuJoCo envs.

Envs of one worker process are stepped in one loop in that process
(:class:`VectorEnv`): on a 2-core machine that steps 32 HalfCheetah envs
about 3x faster than ``AsyncVectorEnv``, whose per-step pipe traffic costs
more than the physics.

The MuJoCo envs that :func:`make_env` builds in one process share one
compiled model per model file (each has its own ``MjData``): see
:func:`make_env`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

log = logging.getLogger(__name__)

#: Tasks that are tested and shipped with configs. Any other gymnasium id works too.
SUPPORTED_ENVS = ("HalfCheetah-v5", "Hopper-v5", "Walker2d-v5", "Ant-v5", "InvertedPendulum-v5")

_QUIET_WARNINGS = ("'settotalmass' is deprecated",)
_USER_CALLBACKS = ("passive", "control", "contactfilter", "sensor", "act_dyn", "act_gain", "act_bias")
_prepared = False


def prepare_mujoco() -> None:
    """Set up MuJoCo for the envs of this process, once (every place edgerl builds envs calls it).

    - MuJoCo's C-level warnings go to logging, known-noisy ones dropped: MuJoCo 4 prints a
      ``settotalmass`` deprecation for every HalfCheetah/Ant env it compiles, which buries the
      output of a 64-env run.
    - MuJoCo's stage timers are turned off. The ``mujoco`` package installs a timer callback
      (``mjcb_time``, a ``clock_gettime`` call) that ``mj_step`` calls at the start and end of
      every stage to fill ``MjData.timer``, which no env or edgerl reads. On the reference 2-core
      machine that was 7.5 % of a bare ``mj_step`` loop's samples, and 64 envs stepped 1.11x
      faster without it (HalfCheetah-v5), 1.13x (Hopper-v5), 1.08x (Ant-v5) and 1.35x
      (InvertedPendulum-v5). ``MjData.timer`` durations then stay 0. Where a callback of the
      user's own is set (any ``mujoco.set_mjcb_*``), all are left as they are: MuJoCo resets
      them together (``mj_resetCallbacks``).
    """
    global _prepared  # noqa: PLW0603 - process-wide C hooks, set once
    if _prepared:
        return
    import mujoco

    def _handler(message: str) -> None:
        if not any(q in message for q in _QUIET_WARNINGS):
            log.warning("mujoco: %s", message)

    # The package's own timer reads as None: get_mjcb_time reports callbacks set from Python.
    if all(getattr(mujoco, f"get_mjcb_{name}")() is None for name in ("time", *_USER_CALLBACKS)):
        mujoco.mj_resetCallbacks()  # every mjcb_* to NULL, the timer included; not the warning hook
    mujoco.set_mju_user_warning(_handler)
    _prepared = True


@dataclass(frozen=True)
class EnvSpec:
    """Spaces of one env, as the edge server needs them."""

    env_name: str
    obs_shape: tuple[int, ...]
    act_shape: tuple[int, ...]
    act_low: np.ndarray
    act_high: np.ndarray
    obs_low: np.ndarray
    obs_high: np.ndarray


def make_env(env_name: str, *, share_model: bool = True, **kwargs: Any) -> gym.Env[Any, Any]:
    """``gym.make(env_name, **kwargs)`` with MuJoCo prepared.

    With ``share_model`` (the default), a MuJoCo env shares its compiled ``MjModel`` with the
    other envs of this process built from the same model file at the same framebuffer size;
    each env still has its own ``MjData``, so their states are apart and each steps exactly as
    an env of its own model would. Gymnasium's envs only read their model. A HalfCheetah-v5
    model takes 0.5 MB, so 100 envs of their own hold 52 MB of identical models, and stepping
    them in turn reads each into the caches again. With one model, 100 HalfCheetah robots took
    46 MB instead of 107-111 MB, and stepped 1.14x faster (64 envs of a sim worker: 1.07x;
    Hopper and Ant: 1.02-1.04x; see the performance log). Pass ``share_model=False`` for an
    env whose model is changed (say, its masses randomised per env). A model whose file, or a
    file it includes or a mesh it names, was written again is compiled again, and a model is let
    go with the last env that uses it. Envs that are not MuJoCo's are built as they are.

    Raises:
        ValueError: gymnasium refused the env (an unknown id, say), named in the message.
    """
    prepare_mujoco()
    # None for an id gymnasium resolves itself ("module:Env-v0", an unknown one): built as it is
    spec = gym.envs.registry.get(env_name) if share_model else None
    try:
        return gym.make(env_name if spec is None else _sharing_model(spec), **kwargs)
    except gym.error.Error as exc:
        raise ValueError(f"env {env_name!r}: {exc}") from exc


_shared_lock = threading.Lock()
# (model file, model_files_key of it, width, height) -> MjModel, held only while an env holds it
_shared_models: weakref.WeakValueDictionary[tuple[str, tuple[Any, ...], int, int], Any] = (
    weakref.WeakValueDictionary()
)
# model file -> model_files_key of it when a model of it was last compiled
_files_compiled: dict[str, tuple[Any, ...]] = {}
# digest of an MJCF file's bytes -> _named_files of them (the last _MAX_PARSED contents)
_parsed: dict[bytes, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {}
_MAX_PARSED = 64
_COMPILER_DIRS = ("meshdir", "texturedir", "assetdir")


def model_files_key(path: str) -> tuple[Any, ...]:
    """What :func:`make_env`'s shared models are keyed by of the files a MuJoCo model file
    ``path`` is compiled from: a digest of the bytes of ``path`` and of every XML file it names
    (``<include>``, ``<model>``), read through, and the size and modification time of every other
    file it names (meshes, textures, height fields, skins: any ``file*`` attribute), at each
    place the compiler may look for it (beside the model file, beside the naming file, and under
    each ``meshdir``, ``texturedir`` and ``assetdir`` of a ``<compiler>``). A place with no file
    counts too, so a file that appears there later is seen. A file that cannot be parsed as XML
    is keyed by its bytes alone (the compiler then says what is wrong with it). Each content is
    parsed once (the last 64 kept): every env of a model keys it again. Not thread-safe:
    :func:`make_env` calls it under its lock.
    """
    root_dir = os.path.dirname(os.path.abspath(path))
    key: list[Any] = []
    seen: set[str] = set()
    xml_files = [os.path.abspath(path)]
    assets: list[tuple[str, str]] = []  # (name as written, folder of the file that names it)
    dirs = [root_dir]
    while xml_files:
        name = xml_files.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            with open(name, "rb") as f:
                data = f.read()
        except OSError:
            key.append((name, None))
            continue
        digest = hashlib.blake2b(data, digest_size=16).digest()
        key.append((name, digest))
        if digest not in _parsed:
            if len(_parsed) >= _MAX_PARSED:
                del _parsed[next(iter(_parsed))]
            _parsed[digest] = _named_files(data)
        compiler_dirs, xml_names, asset_names = _parsed[digest]
        here = os.path.dirname(name)
        dirs += [os.path.join(root_dir, d) for d in compiler_dirs]
        for value in xml_names:
            xml_files += sorted({os.path.join(root_dir, value), os.path.join(here, value)})
        assets += [(value, here) for value in asset_names]
    for value, here in assets:
        for place in sorted({os.path.join(d, value) for d in (*dirs, here)}):
            try:
                st = os.stat(place)
            except OSError:
                key.append((place, None))
            else:
                key.append((place, st.st_size, st.st_mtime_ns))
    return tuple(key)


def _named_files(data: bytes) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The folders that the ``<compiler>`` elements of an MJCF file's bytes ``data`` set, and the
    XML files and the other files its elements name, in the order written; nothing where
    ``data`` is not XML."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.fromstring(data)
    except ET.ParseError:
        return (), (), ()
    dirs: list[str] = []
    xml_names: list[str] = []
    asset_names: list[str] = []
    for element in root.iter():
        if element.tag == "compiler":
            dirs += [element.get(d, "") for d in _COMPILER_DIRS if element.get(d)]
        for attr, value in element.attrib.items():
            if attr.startswith("file") and value:
                is_xml = element.tag in ("include", "model") or value.lower().endswith(".xml")
                (xml_names if is_xml else asset_names).append(value)
    return tuple(dirs), tuple(xml_names), tuple(asset_names)


def _sharing_model(spec: gym.envs.registration.EnvSpec) -> gym.envs.registration.EnvSpec:
    """``spec`` with an entry point whose envs share their compiled model, where it builds a
    gymnasium ``MujocoEnv``; else ``spec`` itself."""
    from gymnasium.envs.mujoco.mujoco_env import MujocoEnv
    from gymnasium.envs.registration import load_env_creator

    entry = spec.entry_point
    creator = entry if callable(entry) or entry is None else load_env_creator(entry)
    if not (isinstance(creator, type) and issubclass(creator, MujocoEnv)):
        return spec
    return dataclasses.replace(spec, entry_point=_sharing_class(creator))


@functools.cache
def _sharing_class(creator: type) -> type:
    """``creator``, a ``MujocoEnv`` class, as a subclass of the same name whose envs share their
    compiled model (:func:`_shared_simulation`); one per class."""
    own = creator._initialize_simulation  # type: ignore[attr-defined]

    def initialize(env: Any) -> tuple[Any, Any]:
        return _shared_simulation(env, own)

    attrs = {"_initialize_simulation": initialize, "__doc__": creator.__doc__}
    return type(creator.__name__, (creator,), attrs)


def _shared_simulation(env: Any, compile_model: Callable[[Any], tuple[Any, Any]]) -> tuple[Any, Any]:
    """``MujocoEnv._initialize_simulation`` with the model compiled once per file and size: the
    first env of a key compiles it as its class does (``compile_model``: gymnasium's method,
    which also grows the framebuffer to the env's size), the next ones take it with an
    ``MjData`` of their own.

    The key holds a digest of the bytes of the model file and of the XML files it includes,
    and the size and modification time of its meshes and textures (:func:`model_files_key`), so a
    model whose files were written again (edited between two runs of a notebook, say) is
    compiled again. The cache holds a model only as long as an env does (each ``MjData`` holds
    its model): a process that goes through many model files keeps only those of its live envs.
    """
    import mujoco

    with _shared_lock:
        files = model_files_key(env.fullpath)
        key = (env.fullpath, files, env.width, env.height)
        model = _shared_models.get(key)
        if model is None:
            if _files_compiled.setdefault(env.fullpath, files) != files:
                # MuJoCo's own asset cache knows a mesh by name and modification second: one
                # written again within the second would come from it as it was
                mujoco.mj_clearCache(mujoco.mj_getCache())
                _files_compiled[env.fullpath] = files
            model, data = compile_model(env)
            _shared_models[key] = model
            return model, data
    return model, mujoco.MjData(model)


def env_spec(env_name: str) -> EnvSpec:
    """Build one env, read its spaces, close it.

    Raises:
        ValueError: the env is unknown or its spaces are not continuous boxes.
    """
    env = make_env(env_name)
    try:
        return _spec_of(env, env_name)
    finally:
        env.close()


def _spec_of(env: gym.Env[Any, Any], env_name: str) -> EnvSpec:
    """The spaces of ``env``, an env of ``env_name``.

    Raises:
        ValueError: its spaces are not continuous boxes.
    """
    obs_space, act_space = env.observation_space, env.action_space
    if not isinstance(obs_space, gym.spaces.Box) or not isinstance(act_space, gym.spaces.Box):
        raise ValueError(f"env {env_name!r}: edgerl needs Box observation and action spaces")
    return EnvSpec(
        env_name=env_name,
        obs_shape=tuple(obs_space.shape),
        act_shape=tuple(act_space.shape),
        act_low=np.asarray(act_space.low, dtype=np.float32),
        act_high=np.asarray(act_space.high, dtype=np.float32),
        obs_low=np.asarray(obs_space.low, dtype=np.float32),
        obs_high=np.asarray(obs_space.high, dtype=np.float32),
    )


class VectorEnv:
    """``num_envs`` copies of a gymnasium env stepped in a loop, with ``NEXT_STEP`` autoreset.

    The same transitions as ``gym.vector.SyncVectorEnv`` (gymnasium 1.x's
    default autoreset: the step after an episode ends resets that env, ignores
    its action and reports reward 0, not terminated, not truncated), without
    what edgerl never reads: the per-step merging of the envs' info dicts and
    the passive env checker's wrapper. On Hopper-v5 that is ~20 % of a step,
    and a sim worker's core is the bottleneck of a training run there.
    """

    def __init__(self, env_name: str, num_envs: int) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.envs = [make_env(env_name, disable_env_checker=True) for _ in range(num_envs)]
        self.env_name = env_name
        self.num_envs = num_envs
        self._autoreset = np.zeros(num_envs, bool)

    def spec(self) -> EnvSpec:
        """The spaces of one of the envs (:func:`env_spec` without building another).

        Raises:
            ValueError: its spaces are not continuous boxes.
        """
        return _spec_of(self.envs[0], self.env_name)

    def reset(self, seed: int) -> np.ndarray:
        """Reset env ``i`` with seed ``seed + i``; float32 observations ``[num_envs, *obs_shape]``."""
        self._autoreset[:] = False
        return np.stack([np.asarray(e.reset(seed=seed + i)[0], np.float32) for i, e in enumerate(self.envs)])

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Step env ``i`` with ``actions[i]``; returns observations (float32), rewards (float32),
        terminated and truncated (bool), each with a leading ``num_envs`` axis."""
        n = self.num_envs
        obs: list[np.ndarray] = [np.empty(0)] * n
        rewards = np.zeros(n, np.float32)
        terminated = np.zeros(n, bool)
        truncated = np.zeros(n, bool)
        autoreset = self._autoreset
        for i, env in enumerate(self.envs):
            if autoreset[i]:
                obs[i] = env.reset()[0]
                continue
            obs[i], rewards[i], terminated[i], truncated[i], _ = env.step(actions[i])
        np.logical_or(terminated, truncated, out=autoreset)
        return np.asarray(obs, np.float32), rewards, terminated, truncated

    def close(self) -> None:
        for env in self.envs:
            env.close()


def make_vector_env(env_name: str, num_envs: int, seed: int) -> tuple[VectorEnv, np.ndarray]:
    """A :class:`VectorEnv` of ``num_envs`` copies reset with seeds ``seed..seed+n-1``.

    Returns:
        The envs and their first observations, float32 ``[num_envs, *obs_shape]``.
    """
    envs = VectorEnv(env_name, num_envs)
    return envs, envs.reset(seed)
