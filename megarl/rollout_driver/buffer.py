"""The checkpoint of the work in flight: every batch generated ahead and not yet trained on, in
one file (``rollout_buffer.safetensors``) with one entry format, whatever its kind.

An entry is a batch as far as it got: which prompts (``prompt_ids``), ``group_size``, its unit
(``samples`` or ``episodes``), and the samples the file holds (``kept``: their positions in the
batch) with their token ids, the engines' log-probs (float64 holds their Python floats exactly),
finish reasons (None: a sample cut by an interruption) and, where tokens span weight versions,
each token's version. ``version`` is the batch's weight version once it is finished, None while
it is not (an interrupted batch of the opportunistic schedule): such a batch reads back as one
to continue, its samples' seeds and segment counts kept so each continues where it stopped. An
unfinished episode is not kept (its environment's state is not checkpointed): it starts over.
A kept episode that an agent's history rewrite split keeps its earlier parts too (``split_parts``:
how many each episode has; their tokens under ``<index>.parts``): every part trains after a resume.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megarl.rollout.episodes import Trajectory
from megarl.rollout.sampling import RolloutSample
from megarl.rollout_driver.batch import Rollout
from megarl.rollout_driver.inflight import InFlight, Kept
from megarl.rollout_driver.partial_samples import Slot

BUFFER_FILE = "rollout_buffer.safetensors"
FORMAT = "2"  # 1: three entry kinds (finished, interrupted samples, interrupted episodes), no marker

Saved = Rollout | InFlight  # finished, or interrupted (segments or episodes)


def save_buffer(folder: Path, batches: dict[int, Saved]) -> None:
    from safetensors.torch import save_file

    tensors, entries = {}, []
    for index, batch in sorted(batches.items()):
        kept = batch.units.kept() if isinstance(batch, InFlight) else _finished(batch)
        entry = {"index": index, "prompt_ids": list(batch.prompt_ids), "unit": kept.unit,
                 "group_size": batch.group_size if isinstance(batch, InFlight) else len(batch.groups[0]),
                 "version": None if isinstance(batch, InFlight) else batch.version, "kept": kept.kept,
                 "finish_reasons": [s.finish_reason for s in kept.samples], "seeds": None, "segments": None,
                 "versions": None, "interruptions": None} | kept.extra
        samples = kept.samples
        if samples:
            tensors |= _sample_tensors(index, samples)
            if samples[0].routes is not None:  # R3: the experts each token went to, [tokens, layers, k]
                tensors[f"{index}.routes"] = torch.cat([s.routes for s in samples])
        if kept.token_versions is not None and samples:
            tensors[f"{index}.token_versions"] = _ints([v for vs in kept.token_versions for v in vs])
        if kept.episodes:
            tensors |= _episode_tensors(index, kept.episodes)
            entry["episodes"] = [{"finish_reason": t.finish_reason, "info": t.info, "error": t.error}
                                 for t in kept.episodes]
            if parts := [p for t in kept.episodes for p in t.segments]:
                tensors |= _sample_tensors(f"{index}.parts", [p.sample() for p in parts])
                tensors |= _episode_tensors(f"{index}.parts", parts)
                entry["split_parts"] = [len(t.segments) for t in kept.episodes]
                entry["parts"] = [{"finish_reason": p.finish_reason, "info": p.info, "error": p.error} for p in parts]
        entries.append(entry)
    save_file(tensors, str(folder / BUFFER_FILE), metadata={"format": FORMAT, "batches": json.dumps(entries)})


def _finished(rollout: Rollout) -> Kept:
    """A finished batch: every sample, as the trainer will read it back."""
    samples = [s for group in rollout.groups for s in group]
    return Kept("samples" if rollout.episodes is None else "episodes", list(range(len(samples))), samples,
                rollout.token_versions, rollout.episodes)


def load_buffer(folder: Path, manager: Any) -> dict[int, Saved]:
    """The batches ``save_buffer`` wrote (none when the checkpoint has no buffer file, from before
    rollout ran ahead); ``manager`` assembles the finished ones and rebuilds episodes' requests."""
    from safetensors import safe_open

    path = folder / BUFFER_FILE
    if not path.is_file():
        return {}
    batches: dict[int, Saved] = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: a rollout buffer in an older format (not {FORMAT}) that this megarl does not "
                             "read; resume from a checkpoint written by this version, or start the run over")
        for entry in json.loads(meta["batches"]):
            batches[entry["index"]] = _read(f, entry, manager)
    return batches


def _read(f: Any, entry: dict[str, Any], manager: Any) -> Saved:
    index, kept = entry["index"], entry["kept"]
    samples = _read_samples(f, index, entry["finish_reasons"]) if kept else []
    if f"{index}.routes" in f.keys():
        routes = f.get_tensor(f"{index}.routes")
        for s, part in zip(samples, torch.split(routes, [len(s.prompt_ids) + len(s.response_ids) for s in samples]),
                           strict=True):
            s.routes = part
    versions = None
    if f"{index}.token_versions" in f.keys():
        versions = _split(f.get_tensor(f"{index}.token_versions"), torch.tensor([len(s.response_ids) for s in samples]))
    episodes = _read_episodes(f, index, samples, entry["episodes"]) if entry.get("episodes") else None
    if episodes and entry.get("split_parts"):
        parts = iter(_read_episodes(f, f"{index}.parts", _read_samples(f, f"{index}.parts", [
            p["finish_reason"] for p in entry["parts"]]), entry["parts"]))
        for episode, count in zip(episodes, entry["split_parts"], strict=True):
            episode.segments = [next(parts) for _ in range(count)]
    if entry["unit"] == "episodes" and entry["version"] is None:  # interrupted episodes: the finished kept
        batch = manager.episode_batch(index, entry["prompt_ids"], entry["group_size"])
        units = batch.units
        units.interruptions = entry["interruptions"]
        for i, episode, version, tokens in zip(kept, episodes or [], entry["versions"], versions or [], strict=True):
            units.episodes[i], units.versions[i], episode.versions = episode, version, tokens
        return batch
    if entry["version"] is None:  # interrupted samples, each as far as it got
        slots = [Slot(s.prompt_ids, seed, s.response_ids, s.logprobs, tokens, segments, s.finish_reason)
                 for s, seed, tokens, segments in zip(samples, entry["seeds"], versions, entry["segments"],
                                                      strict=True)]
        return manager.segment_batch(index, entry["prompt_ids"], entry["group_size"], slots)
    if episodes is not None:
        samples = [t.sample() for t in episodes]
    n = entry["group_size"]
    rollout = manager.assemble(index, entry["version"], entry["prompt_ids"],
                               [samples[i:i + n] for i in range(0, len(samples), n)], episodes)
    rollout.token_versions = versions
    return rollout


def _sample_tensors(index: int | str, samples: list[RolloutSample]) -> dict[str, torch.Tensor]:
    return {
        f"{index}.prompt_tokens": _ints([t for s in samples for t in s.prompt_ids]),
        f"{index}.prompt_lens": _ints([len(s.prompt_ids) for s in samples]),
        f"{index}.response_tokens": _ints([t for s in samples for t in s.response_ids]),
        f"{index}.response_lens": _ints([len(s.response_ids) for s in samples]),
        f"{index}.logprobs": torch.tensor([lp for s in samples for lp in s.logprobs], dtype=torch.float64),
        f"{index}.logprob_lens": _ints([len(s.logprobs) for s in samples]),
    }


def _read_samples(f: Any, index: int | str, finish_reasons: list[str | None]) -> list[RolloutSample]:
    read = {name: f.get_tensor(f"{index}.{name}") for name in
            ("prompt_tokens", "prompt_lens", "response_tokens", "response_lens", "logprobs", "logprob_lens")}
    return [RolloutSample(p, r, lp, reason) for p, r, lp, reason in zip(
        _split(read["prompt_tokens"], read["prompt_lens"]), _split(read["response_tokens"], read["response_lens"]),
        _split(read["logprobs"], read["logprob_lens"]), finish_reasons, strict=True)]


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _split(flat: torch.Tensor, lengths: torch.Tensor) -> list[list]:
    return [part.tolist() for part in torch.split(flat, lengths.tolist())]


def _episode_tensors(index: int | str, episodes: list[Trajectory]) -> dict[str, torch.Tensor]:
    """What a batch of episodes adds to its samples: masks, rewards, and where turns and
    observations begin (so metrics read back as they were)."""
    return {
        f"{index}.response_mask": _ints([m for t in episodes for m in t.response_mask]),
        f"{index}.rewards": torch.tensor([t.reward for t in episodes], dtype=torch.float64),
        f"{index}.turn_rewards": torch.tensor([r for t in episodes for r in t.turn_rewards], dtype=torch.float64),
        f"{index}.turn_reward_counts": _ints([len(t.turn_rewards) for t in episodes]),
        f"{index}.turn_lens": _ints([len(turn) for t in episodes for turn in t.turns]),
        f"{index}.turn_counts": _ints([len(t.turns) for t in episodes]),
        f"{index}.observation_lens": _ints([len(o) for t in episodes for o in t.observations]),
        f"{index}.observation_counts": _ints([len(t.observations) for t in episodes]),
    }


def _read_episodes(f: Any, index: int | str, samples: list[RolloutSample], meta: list[dict]) -> list[Trajectory]:
    read = {name: f.get_tensor(f"{index}.{name}") for name in
            ("response_mask", "rewards", "turn_lens", "turn_counts", "observation_lens", "observation_counts")}
    masks = _split(read["response_mask"], torch.tensor([len(s.response_ids) for s in samples]))
    turn_lens = _split(read["turn_lens"], read["turn_counts"])
    obs_lens = _split(read["observation_lens"], read["observation_counts"])
    turn_rewards = _split(f.get_tensor(f"{index}.turn_rewards"), f.get_tensor(f"{index}.turn_reward_counts"))
    episodes = []
    for i, sample in enumerate(samples):
        # turn, observation, turn, ...: an episode has one observation fewer than turns, or as many
        order = [x for pair in zip(turn_lens[i], [*obs_lens[i], None], strict=False) for x in pair if x is not None]
        pieces, cursor = [], 0
        for length in order:
            pieces.append(sample.response_ids[cursor:cursor + length])
            cursor += length
        episodes.append(Trajectory(
            sample.prompt_ids, sample.response_ids, masks[i], sample.logprobs, meta[i]["finish_reason"],
            float(read["rewards"][i]), turns=pieces[0::2], observations=pieces[1::2],
            info=dict(meta[i]["info"]), error=meta[i]["error"],
            turn_rewards=turn_rewards[i], routes=sample.routes))
    return episodes
