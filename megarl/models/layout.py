"""Whether a parallel layout fits a model: tp/pp/cp/ep divisibility and the padded vocabulary.

Used wherever a layout is chosen (run validation, convert, the benchmarks), before any rank starts."""

from __future__ import annotations

import math

from megarl.config.schema import ParallelConfig
from megarl.models.hf_arch import ModelArch


def parallel_errors(arch: ModelArch, par: ParallelConfig, where: str, context_parallel: bool = False) -> list[str]:
    """Layout problems of ``par`` for ``arch``; ``where`` prefixes field names (e.g. 'actor.parallel').
    ``context_parallel``: the caller splits sequences over cp ranks (the roles' rank functions do)."""
    errors = []
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(par, name) < 1:
            errors.append(f"{where}.{name}={getattr(par, name)} must be >= 1")
    if errors:
        return errors
    if arch.num_heads % par.tp:
        errors.append(f"{where}.tp={par.tp} does not divide num_attention_heads={arch.num_heads}")
    if arch.num_kv_heads % par.tp:
        errors.append(f"{where}.tp={par.tp} does not divide the query groups "
                      f"(num_key_value_heads={arch.num_kv_heads})")
    if arch.ffn_hidden_size % par.tp and not (arch.is_moe and par.etp is not None):
        errors.append(f"{where}.tp={par.tp} does not divide intermediate_size={arch.ffn_hidden_size}")
    errors += _pipeline_errors(arch, par, where)
    if par.cp > 1 and not context_parallel:  # refused, not run wrong: nothing here splits the sequences
        errors.append(f"{where}.cp={par.cp}: context parallelism runs in the roles of megarl train / sft / rm / "
                      "dpo; convert and the benchmarks do not split sequences over context-parallel ranks; use cp=1")
    elif par.cp > 1 and arch.is_moe:
        errors.append(f"{where}.cp={par.cp}: context parallelism of a mixture-of-experts model is not supported "
                      "yet; use cp=1")
    if par.sequence_parallel and par.tp == 1:
        errors.append(f"{where}.sequence_parallel=true needs tp > 1")
    if par.ep > 1 and not arch.is_moe:
        errors.append(f"{where}.ep={par.ep} needs a mixture-of-experts model ({arch.family} has none)")
    if arch.is_moe and arch.num_experts % par.ep:
        errors.append(f"{where}.ep={par.ep} does not divide num_local_experts={arch.num_experts}")
    if par.etp is not None:
        if par.etp < 1:
            errors.append(f"{where}.etp={par.etp} must be >= 1")
            return errors
        if not arch.is_moe:
            errors.append(f"{where}.etp={par.etp} needs a mixture-of-experts model ({arch.family} has none)")
        elif arch.ffn_hidden_size % par.etp:
            errors.append(f"{where}.etp={par.etp} does not divide the experts' intermediate size "
                          f"({arch.ffn_hidden_size})")
    ranks = par.ranks
    if ranks % par.model_parallel_size:
        errors.append(f"{where}.world_size={ranks} is not a multiple of tp*pp*cp="
                      f"{par.model_parallel_size}")
    elif par.dp is not None and par.world_size is not None and ranks != par.model_parallel_size * par.dp:
        errors.append(f"{where}.world_size={ranks} != tp*pp*cp*dp = "
                      f"{par.tp}*{par.pp}*{par.cp}*{par.dp}")
    if par.ep > 1 and par.etp is None and (ranks // (par.tp * par.pp)) % par.ep:
        errors.append(f"{where}.ep={par.ep} does not divide the {ranks // (par.tp * par.pp)} "
                      "ranks of a pipeline stage's data-parallel x context-parallel group")
    elif par.etp is not None and ranks % (par.etp * par.ep * par.pp):
        errors.append(f"{where}: {ranks} ranks are not a multiple of etp*ep*pp = {par.etp}*{par.ep}*{par.pp} "
                      "(each expert's split times the expert groups of a pipeline stage)")
    return errors


def _pipeline_errors(arch: ModelArch, par: ParallelConfig, where: str) -> list[str]:
    layers, pp = arch.num_layers, par.pp
    first, last = par.first_stage_layers, par.last_stage_layers
    if (first is not None or last is not None) and pp == 1:
        return [f"{where}.first_stage_layers/last_stage_layers need pp > 1"]
    custom = [n for n in (first, last) if n is not None]
    remaining = layers - sum(custom)
    middle = pp - len(custom)
    # every stage needs layers: the middle stages exist exactly when layers remain for them
    if any(n < 1 for n in custom) or remaining < 0 or (middle == 0) != (remaining == 0):
        return [f"{where}: first_stage_layers={first}, last_stage_layers={last} do not fit "
                f"{layers} layers over pp={pp} stages"]
    if middle and remaining % middle:
        what = "num_hidden_layers" if not custom else "the layers left after the explicit split"
        return [f"{where}.pp={pp} does not divide {what} ({remaining}); "
                f"set {where}.first_stage_layers / last_stage_layers for an uneven split"]
    if par.vpp is not None:
        if pp < 2 or par.vpp < 2:
            return [f"{where}.vpp={par.vpp} needs pp > 1 and vpp > 1"]
        if custom:
            return [f"{where}.vpp with an explicit first/last stage split is not supported"]
        if (layers // pp) % par.vpp:
            return [f"{where}.vpp={par.vpp} does not divide the {layers // pp} layers per stage"]
    return []


def padded_vocab_size(vocab_size: int, pad_multiple: int, tp: int) -> int:
    multiple = math.lcm(pad_multiple, tp)
    return -(-vocab_size // multiple) * multiple
