"""Device mesh, tensor-parallel layout rules and multi-host set-up."""
