"""Code generated from protos/pagedserve/v1/*.proto by `make protos` (grpcio-tools 1.85.1); do not edit.
tests/test_protos.py fails when it is stale."""
