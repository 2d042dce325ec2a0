"""Megatron shard <-> HF tensor recipes and canonical parameter names, against hand-computed slices."""

import dataclasses
from collections import defaultdict

import pytest

from megarl.convert.mapping import (
    Piece,
    Recipe,
    ShardLayout,
    canonical_name,
    hf_tensor_shapes,
    recipe,
)
from megarl.models.hf_arch import ModelArch, RopeConfig

# hidden 64; 8 heads of 8 in 4 query groups (2 heads per group); ffn 96; vocab 100 padded to 128.
ARCH = ModelArch(
    family="llama", vocab_size=100, hidden_size=64, ffn_hidden_size=96, num_layers=2,
    num_heads=8, num_kv_heads=4, head_dim=8, norm_eps=1e-5, tie_embeddings=False, qkv_bias=False,
    max_position_embeddings=128, rope=RopeConfig(theta=10000.0),
)
TIED = dataclasses.replace(ARCH, tie_embeddings=True)
QWEN = dataclasses.replace(ARCH, family="qwen2", qkv_bias=True)
MOE = dataclasses.replace(ARCH, family="mixtral", num_experts=4, moe_topk=2)
# Qwen3: QK-norm, and head_dim 16 where hidden / heads = 8 (q_proj 128 rows for hidden 64)
QWEN3 = dataclasses.replace(ARCH, family="qwen3", head_dim=16)
PADDED = 128

L0 = "model.layers.0."
L1 = "model.layers.1."


def at(tp_rank, tp, padded_vocab=PADDED, **kw):
    return ShardLayout(tp_rank=tp_rank, tp=tp, padded_vocab=padded_vocab, **kw)


def pieces(rec):
    return [(p.hf, p.start, p.stop) for p in rec.pieces]


# --------------------------------------------------------------------------- attention


def test_qkv_tp2_rank1():
    rec = recipe(ARCH, "decoder.layers.0.self_attention.linear_qkv.weight", at(1, 2))
    # rank 1 of 2 holds query groups 2 and 3; a group = 2 q heads (16 rows), 1 k head (8), 1 v head (8)
    assert rec.dim == 0
    assert pieces(rec) == [
        (L0 + "self_attn.q_proj.weight", 32, 48),  # group 2: q rows 2*16 .. 3*16
        (L0 + "self_attn.k_proj.weight", 16, 24),  # k rows 2*8 .. 3*8
        (L0 + "self_attn.v_proj.weight", 16, 24),
        (L0 + "self_attn.q_proj.weight", 48, 64),  # group 3
        (L0 + "self_attn.k_proj.weight", 24, 32),
        (L0 + "self_attn.v_proj.weight", 24, 32),
    ]
    assert rec.shape == (64, 64)  # 2 groups * (16 + 8 + 8) rows, hidden 64 columns
    assert rec.hf_names() == [L0 + "self_attn.k_proj.weight", L0 + "self_attn.q_proj.weight",
                              L0 + "self_attn.v_proj.weight"]


def test_qkv_tp2_rank0_and_layer_index():
    rec = recipe(ARCH, "decoder.layers.1.self_attention.linear_qkv.weight", at(0, 2))
    assert pieces(rec) == [
        (L1 + "self_attn.q_proj.weight", 0, 16), (L1 + "self_attn.k_proj.weight", 0, 8),
        (L1 + "self_attn.v_proj.weight", 0, 8), (L1 + "self_attn.q_proj.weight", 16, 32),
        (L1 + "self_attn.k_proj.weight", 8, 16), (L1 + "self_attn.v_proj.weight", 8, 16),
    ]
    assert rec.shape == (64, 64)


def test_qkv_tp4_rank3_is_the_last_group():
    rec = recipe(ARCH, "decoder.layers.0.self_attention.linear_qkv.weight", at(3, 4))
    assert pieces(rec) == [
        (L0 + "self_attn.q_proj.weight", 48, 64),
        (L0 + "self_attn.k_proj.weight", 24, 32),
        (L0 + "self_attn.v_proj.weight", 24, 32),
    ]
    assert rec.shape == (32, 64)  # 16 + 8 + 8


def test_qkv_tp1_interleaves_all_four_groups():
    rec = recipe(ARCH, "decoder.layers.0.self_attention.linear_qkv.weight", at(0, 1))
    q, k, v = (L0 + f"self_attn.{x}_proj.weight" for x in "qkv")
    assert pieces(rec) == [
        (q, 0, 16), (k, 0, 8), (v, 0, 8),
        (q, 16, 32), (k, 8, 16), (v, 8, 16),
        (q, 32, 48), (k, 16, 24), (v, 16, 24),
        (q, 48, 64), (k, 24, 32), (v, 24, 32),
    ]
    assert rec.shape == (128, 64)  # 64 q + 32 k + 32 v rows


def test_qkv_bias():
    rec = recipe(QWEN, "decoder.layers.0.self_attention.linear_qkv.bias", at(1, 2))
    assert rec.dim == 0
    assert pieces(rec) == [
        (L0 + "self_attn.q_proj.bias", 32, 48), (L0 + "self_attn.k_proj.bias", 16, 24),
        (L0 + "self_attn.v_proj.bias", 16, 24), (L0 + "self_attn.q_proj.bias", 48, 64),
        (L0 + "self_attn.k_proj.bias", 24, 32), (L0 + "self_attn.v_proj.bias", 24, 32),
    ]
    assert rec.shape == (64,)  # 1-D


def test_linear_proj_is_a_column_slice():
    rec = recipe(ARCH, "decoder.layers.0.self_attention.linear_proj.weight", at(1, 2))
    # o_proj is (64, 8 heads * 8 = 64); rank 1 of 2 gets columns 32..64
    assert rec.dim == 1
    assert pieces(rec) == [(L0 + "self_attn.o_proj.weight", 32, 64)]
    assert rec.shape == (64, 32)


# --------------------------------------------------------------------------- MLP


def test_fc1_is_gate_rows_then_up_rows():
    rec = recipe(ARCH, "decoder.layers.0.mlp.linear_fc1.weight", at(0, 2))
    assert rec.dim == 0
    assert pieces(rec) == [(L0 + "mlp.gate_proj.weight", 0, 48), (L0 + "mlp.up_proj.weight", 0, 48)]
    assert rec.shape == (96, 64)  # 2 * 96/2 rows
    rec = recipe(ARCH, "decoder.layers.1.mlp.linear_fc1.weight", at(1, 2))
    assert pieces(rec) == [(L1 + "mlp.gate_proj.weight", 48, 96), (L1 + "mlp.up_proj.weight", 48, 96)]


def test_fc1_tp1_is_whole_gate_then_whole_up():
    rec = recipe(ARCH, "decoder.layers.0.mlp.linear_fc1.weight", at(0, 1))
    assert pieces(rec) == [(L0 + "mlp.gate_proj.weight", 0, 96), (L0 + "mlp.up_proj.weight", 0, 96)]
    assert rec.shape == (192, 64)


def test_fc2_is_a_column_slice():
    rec = recipe(ARCH, "decoder.layers.1.mlp.linear_fc2.weight", at(1, 2))
    # down_proj is (64, 96); rank 1 of 2 gets columns 48..96
    assert rec.dim == 1
    assert pieces(rec) == [(L1 + "mlp.down_proj.weight", 48, 96)]
    assert rec.shape == (64, 48)
    rec = recipe(ARCH, "decoder.layers.1.mlp.linear_fc2.weight", at(2, 3))  # 96 / 3 = 32 columns each
    assert pieces(rec) == [(L1 + "mlp.down_proj.weight", 64, 96)]
    assert rec.shape == (64, 32)


# --------------------------------------------------------------------------- norms


@pytest.mark.parametrize(("canonical", "hf"), [
    ("decoder.layers.0.input_layernorm.weight", L0 + "input_layernorm.weight"),
    ("decoder.layers.1.pre_mlp_layernorm.weight", L1 + "post_attention_layernorm.weight"),
    ("decoder.final_layernorm.weight", "model.norm.weight"),
])
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_norms_are_replicated(canonical, hf, tp_rank):
    rec = recipe(ARCH, canonical, at(tp_rank, 2))
    assert rec == Recipe(0, (Piece(hf, 0, 64),), (64,))


# --------------------------------------------------------------------------- vocabulary


def test_word_embeddings_tp2():
    # padded 128 / tp 2 = 64 rows per rank
    rec = recipe(ARCH, "embedding.word_embeddings.weight", at(0, 2))
    assert rec.dim == 0
    assert pieces(rec) == [("model.embed_tokens.weight", 0, 64)]
    assert rec.shape == (64, 64)
    rec = recipe(ARCH, "embedding.word_embeddings.weight", at(1, 2))
    # rows 64..100 are real, 100..128 are padding (28 rows)
    assert pieces(rec) == [("model.embed_tokens.weight", 64, 100), (None, 100, 128)]
    assert rec.pieces[1].length == 28
    assert rec.shape == (64, 64)
    assert rec.hf_names() == ["model.embed_tokens.weight"]


def test_word_embeddings_tp1_pads_at_the_end():
    rec = recipe(ARCH, "embedding.word_embeddings.weight", at(0, 1))
    assert pieces(rec) == [("model.embed_tokens.weight", 0, 100), (None, 100, 128)]
    assert rec.shape == (128, 64)


def test_word_embeddings_rank_entirely_in_the_padding():
    # vocab 100 padded to 256 over tp 4: 64 rows per rank; rank 2 = rows 128..192, all padding
    rec = recipe(ARCH, "embedding.word_embeddings.weight", at(2, 4, padded_vocab=256))
    assert pieces(rec) == [(None, 128, 192)]
    assert rec.shape == (64, 64)
    assert rec.hf_names() == []
    rec = recipe(ARCH, "embedding.word_embeddings.weight", at(1, 4, padded_vocab=256))
    assert pieces(rec) == [("model.embed_tokens.weight", 64, 100), (None, 100, 128)]


def test_word_embeddings_without_padding():
    arch = dataclasses.replace(ARCH, vocab_size=128)
    rec = recipe(arch, "embedding.word_embeddings.weight", at(1, 2))
    assert pieces(rec) == [("model.embed_tokens.weight", 64, 128)]  # no empty padding piece


def test_output_layer_sources():
    untied = recipe(ARCH, "output_layer.weight", at(1, 2))
    assert pieces(untied) == [("lm_head.weight", 64, 100), (None, 100, 128)]
    assert untied.shape == (64, 64)
    tied = recipe(TIED, "output_layer.weight", at(1, 2))
    assert pieces(tied) == [("model.embed_tokens.weight", 64, 100), (None, 100, 128)]
    # the input embedding reads embed_tokens whether tied or not
    assert pieces(recipe(TIED, "embedding.word_embeddings.weight", at(0, 2))) == [("model.embed_tokens.weight", 0, 64)]


@pytest.mark.parametrize("arch", [ARCH, TIED])
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_value_head_output_layer_reads_score(arch, tp_rank):
    rec = recipe(arch, "output_layer.weight", at(tp_rank, 2), value_head=True)
    assert rec == Recipe(0, (Piece("score.weight", 0, 1),), (1, 64))
    # value_head does not change the input embedding
    assert pieces(recipe(arch, "embedding.word_embeddings.weight", at(0, 2), value_head=True)) == [
        ("model.embed_tokens.weight", 0, 64)]


# --------------------------------------------------------------------------- MoE


def test_router_is_replicated():
    rec = recipe(MOE, "decoder.layers.1.mlp.router.weight", at(1, 2))
    assert rec == Recipe(0, (Piece(L1 + "block_sparse_moe.gate.weight", 0, 4),), (4, 64))


def test_expert_fc1_and_fc2():
    # the canonical expert index is global: local_experts.3 is HF expert 3
    rec = recipe(MOE, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", at(1, 2))
    e3 = L1 + "block_sparse_moe.experts.3."
    assert rec.dim == 0
    assert pieces(rec) == [(e3 + "w1.weight", 48, 96), (e3 + "w3.weight", 48, 96)]  # gate (w1), then up (w3)
    assert rec.shape == (96, 64)
    rec = recipe(MOE, "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight", at(0, 2))
    assert rec.dim == 1
    assert pieces(rec) == [(L0 + "block_sparse_moe.experts.0.w2.weight", 0, 48)]
    assert rec.shape == (64, 48)
    rec = recipe(MOE, "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight", at(0, 1))
    assert pieces(rec) == [(L0 + "block_sparse_moe.experts.2.w1.weight", 0, 96),
                           (L0 + "block_sparse_moe.experts.2.w3.weight", 0, 96)]


@pytest.mark.parametrize("name", [
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",  # TE name: canonicalize first
    "decoder.layers.0.mlp.unknown.weight",
    "decoder.something.weight",
    "embedding.position_embeddings.weight",
    "decoder.layers.0.mlp.experts.local_experts.x.linear_fc1.weight",
])
def test_unknown_names_raise_key_error(name):
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        recipe(ARCH, name, at(0, 1))


# --------------------------------------------------------------------------- canonical_name


@pytest.mark.parametrize(("local", "global_layer", "ep_rank", "experts_per_rank", "expected"), [
    ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", 5, 0, 1,
     "decoder.layers.5.input_layernorm.weight"),
    ("decoder.layers.1.mlp.linear_fc1.layer_norm_weight", 1, 0, 1,
     "decoder.layers.1.pre_mlp_layernorm.weight"),
    ("decoder.layers.12.mlp.linear_fc1.layer_norm_weight", 30, 0, 1,
     "decoder.layers.30.pre_mlp_layernorm.weight"),
    ("decoder.layers.0.self_attention.linear_qkv.weight", 3, 0, 1,
     "decoder.layers.3.self_attention.linear_qkv.weight"),
    # local spec names are already canonical apart from the layer
    ("decoder.layers.2.input_layernorm.weight", 7, 0, 1, "decoder.layers.7.input_layernorm.weight"),
    # local expert 1 on ep rank 1 with 2 experts per rank = global expert 1*2 + 1 = 3
    ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 4, 1, 2,
     "decoder.layers.4.mlp.experts.local_experts.3.linear_fc1.weight"),
    # expert 0 on ep rank 3 with 4 per rank = 12
    ("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight", 0, 3, 4,
     "decoder.layers.0.mlp.experts.local_experts.12.linear_fc2.weight"),
    # names outside the layers are untouched
    ("embedding.word_embeddings.weight", None, 0, 1, "embedding.word_embeddings.weight"),
    ("decoder.final_layernorm.weight", None, 0, 1, "decoder.final_layernorm.weight"),
    ("output_layer.weight", None, 0, 1, "output_layer.weight"),
    # no global layer given: the index is kept
    ("decoder.layers.3.mlp.linear_fc1.layer_norm_weight", None, 0, 1,
     "decoder.layers.3.pre_mlp_layernorm.weight"),
])
def test_canonical_name(local, global_layer, ep_rank, experts_per_rank, expected):
    assert canonical_name(local, global_layer, ep_rank, experts_per_rank) == expected


# --------------------------------------------------------------------------- hf_tensor_shapes


def test_hf_tensor_shapes_one_layer_untied():
    arch = dataclasses.replace(ARCH, num_layers=1)
    shapes = hf_tensor_shapes(arch)
    assert list(shapes.items()) == [  # checkpoint order
        ("model.embed_tokens.weight", (100, 64)),
        (L0 + "input_layernorm.weight", (64,)),
        (L0 + "self_attn.q_proj.weight", (64, 64)),  # 8 heads * 8
        (L0 + "self_attn.k_proj.weight", (32, 64)),  # 4 kv heads * 8
        (L0 + "self_attn.v_proj.weight", (32, 64)),
        (L0 + "self_attn.o_proj.weight", (64, 64)),
        (L0 + "post_attention_layernorm.weight", (64,)),
        (L0 + "mlp.gate_proj.weight", (96, 64)),
        (L0 + "mlp.up_proj.weight", (96, 64)),
        (L0 + "mlp.down_proj.weight", (64, 96)),
        ("model.norm.weight", (64,)),
        ("lm_head.weight", (100, 64)),
    ]


def test_hf_tensor_shapes_tied_and_value_head():
    assert "lm_head.weight" in hf_tensor_shapes(ARCH)
    assert "lm_head.weight" not in hf_tensor_shapes(TIED)
    assert len(hf_tensor_shapes(ARCH)) == 1 + 2 * 9 + 1 + 1  # 21
    assert len(hf_tensor_shapes(TIED)) == 20
    for arch in (ARCH, TIED):
        shapes = hf_tensor_shapes(arch, value_head=True)
        assert shapes["score.weight"] == (1, 64)
        assert "lm_head.weight" not in shapes
        assert len(shapes) == 21


def test_hf_tensor_shapes_qkv_bias():
    shapes = hf_tensor_shapes(QWEN)
    assert shapes[L1 + "self_attn.q_proj.bias"] == (64,)
    assert shapes[L1 + "self_attn.k_proj.bias"] == (32,)
    assert shapes[L1 + "self_attn.v_proj.bias"] == (32,)
    assert L1 + "self_attn.o_proj.bias" not in shapes
    assert len(shapes) == 21 + 2 * 3
    assert not any(name.endswith(".bias") for name in hf_tensor_shapes(ARCH))


def test_hf_tensor_shapes_moe():
    shapes = hf_tensor_shapes(MOE)
    assert shapes[L0 + "block_sparse_moe.gate.weight"] == (4, 64)
    for e in range(4):
        assert shapes[f"{L0}block_sparse_moe.experts.{e}.w1.weight"] == (96, 64)
        assert shapes[f"{L0}block_sparse_moe.experts.{e}.w2.weight"] == (64, 96)
        assert shapes[f"{L0}block_sparse_moe.experts.{e}.w3.weight"] == (96, 64)
    assert f"{L0}block_sparse_moe.experts.4.w1.weight" not in shapes
    assert not any(".mlp." in name for name in shapes)
    # per layer: 2 norms + 4 attention + router + 4 experts * 3 = 19
    assert len(shapes) == 1 + 2 * 19 + 1 + 1


# --------------------------------------------------------------------------- coverage property


def dense_canonical_names(num_layers):
    names = ["embedding.word_embeddings.weight"]
    for i in range(num_layers):
        names += [
            f"decoder.layers.{i}.input_layernorm.weight",
            f"decoder.layers.{i}.self_attention.linear_qkv.weight",
            f"decoder.layers.{i}.self_attention.linear_proj.weight",
            f"decoder.layers.{i}.pre_mlp_layernorm.weight",
            f"decoder.layers.{i}.mlp.linear_fc1.weight",
            f"decoder.layers.{i}.mlp.linear_fc2.weight",
        ]
    return names + ["decoder.final_layernorm.weight", "output_layer.weight"]


REPLICATED = ("input_layernorm.weight", "pre_mlp_layernorm.weight", "final_layernorm.weight")

# Shapes of the HF tensors of ARCH, written out by hand.
HF_SHAPES = {"model.embed_tokens.weight": (100, 64), "model.norm.weight": (64,), "lm_head.weight": (100, 64)}
for _i in range(2):
    _p = f"model.layers.{_i}."
    HF_SHAPES |= {
        _p + "input_layernorm.weight": (64,), _p + "post_attention_layernorm.weight": (64,),
        _p + "self_attn.q_proj.weight": (64, 64), _p + "self_attn.k_proj.weight": (32, 64),
        _p + "self_attn.v_proj.weight": (32, 64), _p + "self_attn.o_proj.weight": (64, 64),
        _p + "mlp.gate_proj.weight": (96, 64), _p + "mlp.up_proj.weight": (96, 64),
        _p + "mlp.down_proj.weight": (64, 96),
    }


def assert_exact_cover(intervals, size, what):
    """The intervals tile [0, size): no gap, no overlap."""
    position = 0
    for start, stop in sorted(intervals):
        assert start == position, f"{what}: gap or overlap at {position} (next piece starts at {start})"
        assert stop > start, f"{what}: empty piece at {start}"
        position = stop
    assert position == size, f"{what}: covered up to {position} of {size}"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shards_cover_every_hf_tensor_exactly_once(tp):
    assert hf_tensor_shapes(ARCH) == HF_SHAPES
    names = dense_canonical_names(2)
    assert len(names) == 15
    used = set()
    for canonical in names:
        ranks = range(1) if canonical.endswith(REPLICATED) else range(tp)
        covered = defaultdict(list)
        padding = 0
        for r in ranks:
            rec = recipe(ARCH, canonical, at(r, tp))
            # the pieces fill the shard along the recipe's dim
            assert sum(p.length for p in rec.pieces) == rec.shape[rec.dim], canonical
            for p in rec.pieces:
                if p.hf is None:
                    padding += p.length
                    continue
                hf_shape = HF_SHAPES[p.hf]
                # every other dim is taken whole
                assert rec.shape[:rec.dim] + rec.shape[rec.dim + 1:] == hf_shape[:rec.dim] + hf_shape[rec.dim + 1:]
                covered[p.hf].append((p.start, p.stop))
        for hf, intervals in covered.items():
            assert_exact_cover(intervals, HF_SHAPES[hf][rec.dim], f"{canonical} -> {hf} at tp={tp}")
        used |= set(covered)
        expected_padding = 28 if canonical in ("embedding.word_embeddings.weight", "output_layer.weight") else 0
        assert padding == expected_padding, canonical  # 128 - 100 rows of vocab padding
    assert used == set(HF_SHAPES)  # every HF tensor is the source of some parameter


@pytest.mark.parametrize("tp", [1, 2])
def test_replicated_params_are_whole_on_every_rank(tp):
    for canonical in dense_canonical_names(2):
        if canonical.endswith(REPLICATED):
            recs = {recipe(ARCH, canonical, at(r, tp)) for r in range(tp)}
            assert len(recs) == 1
            (rec,) = recs
            assert [(p.start, p.stop) for p in rec.pieces] == [(0, 64)]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_bias_shards_cover_exactly_once(tp):
    covered = defaultdict(list)
    for r in range(tp):
        for p in recipe(QWEN, "decoder.layers.1.self_attention.linear_qkv.bias", at(r, tp)).pieces:
            covered[p.hf].append((p.start, p.stop))
    assert sorted(covered) == [L1 + "self_attn.k_proj.bias", L1 + "self_attn.q_proj.bias",
                               L1 + "self_attn.v_proj.bias"]
    assert_exact_cover(covered[L1 + "self_attn.q_proj.bias"], 64, "q bias")
    assert_exact_cover(covered[L1 + "self_attn.k_proj.bias"], 32, "k bias")
    assert_exact_cover(covered[L1 + "self_attn.v_proj.bias"], 32, "v bias")


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_expert_shards_cover_exactly_once(tp):
    # 4 experts over ep 2 (2 per rank): canonical names from the local ones, then recipes per tp rank
    covered = defaultdict(list)
    for ep_rank in range(2):
        for local in range(2):
            for fc in ("linear_fc1", "linear_fc2"):
                name = canonical_name(f"decoder.layers.0.mlp.experts.local_experts.{local}.{fc}.weight",
                                      0, ep_rank, 2)
                for r in range(tp):
                    rec = recipe(MOE, name, at(r, tp))
                    for p in rec.pieces:
                        covered[p.hf].append((p.start, p.stop, rec.dim))
    expected = {f"{L0}block_sparse_moe.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w2", "w3")}
    assert set(covered) == expected
    for hf, intervals in covered.items():
        dims = {d for _, _, d in intervals}
        assert dims == ({1} if ".w2." in hf else {0})  # w2 (down) is split by columns
        assert_exact_cover([(a, b) for a, b, _ in intervals], 96, hf)  # ffn 96 along the split dim


# --------------------------------------------------------------------------- Qwen3


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("canonical", "hf"), [
    ("decoder.layers.1.self_attention.q_layernorm.weight", L1 + "self_attn.q_norm.weight"),
    ("decoder.layers.0.self_attention.k_layernorm.weight", L0 + "self_attn.k_norm.weight"),
])
def test_qwen3_qk_norms_are_whole_on_every_rank(canonical, hf, tp):
    for r in range(tp):
        assert recipe(QWEN3, canonical, at(r, tp)) == Recipe(0, (Piece(hf, 0, 16),), (16,))  # head_dim, not hidden
    with pytest.raises(KeyError, match=canonical.replace(".", r"\.")):
        recipe(ARCH, canonical, at(0, 1))  # a family without QK-norm has no such parameter


def test_qwen3_qkv_and_proj_use_the_explicit_head_dim():
    rec = recipe(QWEN3, "decoder.layers.0.self_attention.linear_qkv.weight", at(1, 2))
    # rank 1 of 2: query groups 2 and 3; a group = 2 q heads (32 rows), 1 k head (16), 1 v head (16)
    assert pieces(rec) == [
        (L0 + "self_attn.q_proj.weight", 64, 96), (L0 + "self_attn.k_proj.weight", 32, 48),
        (L0 + "self_attn.v_proj.weight", 32, 48), (L0 + "self_attn.q_proj.weight", 96, 128),
        (L0 + "self_attn.k_proj.weight", 48, 64), (L0 + "self_attn.v_proj.weight", 48, 64),
    ]
    assert rec.shape == (128, 64)
    rec = recipe(QWEN3, "decoder.layers.0.self_attention.linear_proj.weight", at(1, 2))
    assert pieces(rec) == [(L0 + "self_attn.o_proj.weight", 64, 128)]  # o_proj is (64, 8 heads * 16)
    assert rec.shape == (64, 64)


def test_hf_tensor_shapes_qwen3():
    shapes = hf_tensor_shapes(dataclasses.replace(QWEN3, num_layers=1))
    assert list(shapes.items()) == [  # checkpoint order
        ("model.embed_tokens.weight", (100, 64)),
        (L0 + "input_layernorm.weight", (64,)),
        (L0 + "self_attn.q_proj.weight", (128, 64)),  # 8 heads * 16
        (L0 + "self_attn.k_proj.weight", (64, 64)),  # 4 kv heads * 16
        (L0 + "self_attn.v_proj.weight", (64, 64)),
        (L0 + "self_attn.o_proj.weight", (64, 128)),
        (L0 + "self_attn.q_norm.weight", (16,)),
        (L0 + "self_attn.k_norm.weight", (16,)),
        (L0 + "post_attention_layernorm.weight", (64,)),
        (L0 + "mlp.gate_proj.weight", (96, 64)),
        (L0 + "mlp.up_proj.weight", (96, 64)),
        (L0 + "mlp.down_proj.weight", (64, 96)),
        ("model.norm.weight", (64,)),
        ("lm_head.weight", (100, 64)),
    ]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen3_tp_shards_cover_every_hf_tensor_exactly_once(tp):
    """The coverage property above, for Qwen3: the replicated QK-norms included."""
    shapes = hf_tensor_shapes(QWEN3)
    names = dense_canonical_names(2) + [f"decoder.layers.{i}.self_attention.{x}_layernorm.weight"
                                        for i in range(2) for x in "qk"]
    replicated = REPLICATED + ("q_layernorm.weight", "k_layernorm.weight")
    covered = defaultdict(list)
    for canonical in names:
        for r in range(1) if canonical.endswith(replicated) else range(tp):
            rec = recipe(QWEN3, canonical, at(r, tp))
            assert sum(p.length for p in rec.pieces) == rec.shape[rec.dim], canonical
            for p in rec.pieces:
                if p.hf is not None:
                    covered[p.hf].append((p.start, p.stop, rec.dim))
    assert set(covered) == set(shapes)
    for hf, intervals in covered.items():
        (dim,) = {d for _, _, d in intervals}
        assert_exact_cover([(a, b) for a, b, _ in intervals], shapes[hf][dim], f"{hf} at tp={tp}")
