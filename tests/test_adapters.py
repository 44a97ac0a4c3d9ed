"""``--model BASE+ADAPTER``: a LoRA adapter merged into the base's weights at load equals peft's own (unmerged)
adapted model, and the shipped countdown adapter is what its provenance says."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from kvdiag.core.errors import UserError
from kvdiag.core.safetensors_header import safetensors_shapes
from kvdiag.model.load import load_model
from kvdiag.model.specs import check_model_spec, spec_config, split_adapter

SHIPPED = Path(__file__).parent.parent / "data" / "adapters" / "smollm2-countdown"


@pytest.fixture(scope="module")
def tiny_adapter(tmp_path_factory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A seeded LoRA on tiny:llama saved to a directory, with (peft's unmerged logits, the base's logits) [1, T, V]
    on a fixed input."""
    from peft import LoraConfig, get_peft_model

    path = tmp_path_factory.mktemp("adapter")
    ids = torch.arange(3, 40)[None]
    base = load_model("tiny:llama")
    with torch.no_grad():
        plain = base.model(ids).logits
    torch.manual_seed(1)
    # init_lora_weights=False: B random too, so the adapter changes the model (peft's default B is zero)
    peft_model = get_peft_model(base.model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                       target_modules=["q_proj", "v_proj", "down_proj"]))
    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(ids).logits
    peft_model.save_pretrained(path, safe_serialization=True)
    return path, adapted, plain


def test_merged_adapter_equals_peft(tiny_adapter):
    path, adapted, plain = tiny_adapter
    lm = load_model(f"tiny:llama+{path}")
    with torch.no_grad():
        merged = lm.model(torch.arange(3, 40)[None]).logits
    # merging W + BA in fp32 reorders the sums: equal within 1e-5 absolute on these O(1) logits
    assert torch.allclose(merged, adapted, atol=1e-5), (merged - adapted).abs().max()
    assert (merged - plain).abs().max() > 1e-2  # the adapter does change the model
    assert lm.spec == f"tiny:llama+{path}"
    assert lm.info["weights_hash"] != load_model("tiny:llama").info["weights_hash"]


def test_adapter_is_recorded(tiny_adapter):
    """A Trace's model entry names the adapter and hashes its weights file (besides the merged weights' hash)."""
    path = tiny_adapter[0]
    recorded = load_model(f"tiny:llama+{path}").info["adapter"]
    digest = hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()[:16]
    assert recorded == {"path": str(path), "sha256": digest, "r": 4, "lora_alpha": 8,
                        "target_modules": ["down_proj", "q_proj", "v_proj"]}
    assert "adapter" not in load_model("tiny:llama").info


def test_adapter_for_another_base_is_refused_before_torch(tiny_adapter):
    """peft's own file, read from its header only: tiny:llama's factors (64 features) do not fit smollm2 (576)."""
    path = tiny_adapter[0]
    shapes = safetensors_shapes(path / "adapter_model.safetensors")
    assert shapes["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] == [4, 64]
    assert shapes["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"] == [64, 4]
    with pytest.raises(UserError, match="q_proj has 64 in features, smollm2's 576|down_proj has 128 in features"):
        check_model_spec(f"smollm2+{path}")


def test_any_rank_loads(tmp_path):
    """Rank 32 loads and merges: the issue's rank <= 16 bounds the shipped adapter only."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(2)
    peft_model = get_peft_model(load_model("tiny:llama").model,
                                LoraConfig(r=32, init_lora_weights=False, target_modules=["k_proj"]))
    peft_model.save_pretrained(tmp_path, safe_serialization=True)
    assert load_model(f"tiny:llama+{tmp_path}").info["adapter"]["r"] == 32


def test_adapter_keeps_its_base_config(tiny_adapter):
    path = tiny_adapter[0]
    assert split_adapter(f"smollm2+{path}") == ("smollm2", str(path))
    assert split_adapter("smollm2") == ("smollm2", None)
    assert spec_config(f"smollm2+{path}") == spec_config("smollm2")
    assert check_model_spec(f"tiny:llama+{path}") == f"tiny:llama+{path}"


def test_shipped_adapter_is_small_safetensors_lora():
    if not (SHIPPED / "adapter_model.safetensors").exists():
        pytest.skip("the countdown adapter is not in this checkout")
    config = json.loads((SHIPPED / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] <= 16
    assert (SHIPPED / "adapter_model.safetensors").stat().st_size <= 5_000_000
    assert not list(SHIPPED.glob("*.bin"))
    check_model_spec(f"smollm2+{SHIPPED}")


def _copy_with(src: Path, dst: Path, change) -> Path:
    """A copy of the adapter directory ``src`` whose weights are ``change(tensors)``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "adapter_model.safetensors")
    save_file(change(tensors), dst / "adapter_model.safetensors")
    return dst


def test_an_adapter_that_does_not_fit_is_refused(tiny_adapter, tmp_path):
    """#55: NaN weights (an all-NaN model, exit 0 before), a module the base lacks (peft only warned and left that
    factor random) and a truncated weights file are each one UserError, before any output; the good adapter loads."""
    from safetensors.torch import load_file

    path = tiny_adapter[0]
    first = next(iter(load_file(path / "adapter_model.safetensors")))
    nan = _copy_with(path, tmp_path / "nan", lambda t: {k: v.fill_(float("nan")) if k == first else v
                                                       for k, v in t.items()})
    module, factor = first.rsplit(".lora_", 1)  # a factor of a module the base does not have: <module>_typo
    stray = _copy_with(path, tmp_path / "stray", lambda t: {**t, f"{module}_typo.lora_{factor}": t[first].clone()})
    cut = tmp_path / "cut"
    shutil.copytree(path, cut)
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[: len(data) - 16])
    for adapter, needle in [(nan, "NaN or infinite"), (stray, "the base model lacks"),
                            (cut, "truncated or corrupt")]:
        with pytest.raises(UserError, match=needle):
            load_model(f"tiny:llama+{adapter}")
    assert load_model(f"tiny:llama+{path}").adapter is not None


@pytest.mark.parametrize("kwargs, error, needle", [
    ({"spec": None}, TypeError, "spec=None"), ({"spec": 42}, TypeError, "spec=42"),
    ({"spec": "tiny:llama", "device": 3}, TypeError, "device=3"), ({"spec": "tiny:llama", "seed": "x"}, TypeError,
                                                                   "seed='x'"),
    ({"spec": "tiny:llama", "seed": 2**64}, ValueError, "seed="), ({"spec": "tiny:llama", "dtype": None}, TypeError,
                                                                  "dtype=None"),
])
def test_load_model_names_a_bad_argument(kwargs, error, needle):
    """#55: the Python API refuses an argument of the wrong type in one error naming it (AttributeError before)."""
    with pytest.raises(error, match=re.escape(needle)):
        load_model(**kwargs)
