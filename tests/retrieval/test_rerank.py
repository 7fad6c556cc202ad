"""The optional CrossEncoder reranker, on a tiny random cross-encoder saved to a local folder (with the
bundled embedder's tokenizer): it rescores and reorders the fused candidates; a setting that names no
local folder fails fast."""

from __future__ import annotations

import shutil

import pytest
import torch
from pydantic import ValidationError
from transformers import BertConfig, BertForSequenceClassification

from blendserve_config.settings import Settings
from retrieval.embedder import bundled_model_dir
from retrieval.rerank import Reranker
from retrieval.retriever import RetrievedPassage


@pytest.fixture(scope="module")
def tiny_cross_encoder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cross-encoder")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, num_labels=1)
    BertForSequenceClassification(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(bundled_model_dir() / name, folder / name)
    return folder


def test_the_reranker_orders_by_the_cross_encoder(tiny_cross_encoder):
    reranker = Reranker(tiny_cross_encoder)
    passages = [RetrievedPassage(str(i), f"d{i}", f"T{i}", text, 1.0 / (i + 1))
                for i, text in enumerate(["Paris is in France.", "Berlin is in Germany.", "The Nile flows north."])]
    out = reranker.rerank("Where is Paris?", passages)
    expected = reranker.model.predict([("Where is Paris?", p.passage) for p in passages])
    assert sorted(p.id for p in out) == ["0", "1", "2"]
    assert [p.score for p in out] == pytest.approx(sorted(map(float, expected), reverse=True))
    assert reranker.rerank("q", []) == []


def test_the_reranker_setting_must_name_a_local_folder(tmp_path, tiny_cross_encoder):
    with pytest.raises(ValidationError, match="reranker"):
        Settings(_env_file=None, reranker=tmp_path / "absent")
    assert Settings(_env_file=None, reranker="").retrieval.reranker is None
    assert Settings(_env_file=None, reranker=tiny_cross_encoder).retrieval.reranker == tiny_cross_encoder
