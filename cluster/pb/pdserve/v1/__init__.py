"""Generated protobuf package (pdserve.v1); regenerate with `make proto`."""
