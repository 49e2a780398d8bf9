"""`nemo-dcr receive --device`: a Hugging Face receiver on a GPU (issue 51). Here, without one,
the option's refusals; the GPU path runs in `scripts/device_check.sh --e2e`."""

from __future__ import annotations

import pytest
import torch

from nemo_dcr_callback.cli import main


@pytest.mark.parametrize(("device", "says"), [
    ("tpu9", "'tpu9' is not a device"),
    ("meta", "only cpu and cuda"),
    pytest.param("cuda", "torch sees no CUDA device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a CUDA device is here")),
    pytest.param("cuda:64", "only", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")),
])
def test_a_device_it_cannot_use_is_refused_by_name_before_loading(tmp_path, capsys, device, says):
    store = tmp_path / "empty"  # no keyframe: a refusal after loading would wait for one instead
    store.mkdir()
    assert main(["receive", "--store", f"file://{store}", "--device", device, "--timeout", "5"]) == 2
    err = capsys.readouterr().err
    assert says in err and "--device" in err, err


@pytest.mark.parametrize("other", [["--model-dir", "D"], ["--fp8-dir", "D"], ["--vllm", "D"]])
def test_device_with_a_file_or_vllm_receiver_is_refused(tmp_path, capsys, other):
    assert main(["receive", "--store", f"file://{tmp_path}", "--device", "cuda", *other]) == 2
    assert "--device places a Hugging Face model" in capsys.readouterr().err
