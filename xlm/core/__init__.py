"""Engine core, host side: requests, the paged KV cache manager and the scheduler."""
