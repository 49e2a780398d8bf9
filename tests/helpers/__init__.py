"""What tests share, in one importable place (`from tests.helpers.tensors import perturb`): no
test file imports another test file. Fixtures live in the conftest.py files.

- tensors: special bit patterns, random tensors, perturbed copies
- stores: store wrappers that count or time the requests made of them; races of threads
- versions: a small model's versions published to a store through the TensorSender harness
- relay, s3, faults: the helpers of the relay, S3 and fault-injection tests
- training: the training recipe's verify lines and the store's version records
- vllm_engines: vLLM engines for the tests in tests/integrations/vllm (imports vLLM)
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout
GOLDEN = REPO / "tests" / "golden"  # the fixed checkpoint pair and delta files (tests/golden/README.md)
