"""CompilationConfig: platform kernels per op, the token buckets, the start-up mode and
the compiled-program cache."""

from __future__ import annotations

from dataclasses import dataclass, field

from xlm.config.checks import _require

STARTUP_PROGRAMS = ("all", "largest", "first-use", "used")


@dataclass
class CompilationConfig:
    """Which ops use their platform kernels, the shape buckets, and the compile cache."""

    # [] keeps each op's default; else "all" / "none" followed by "+name" / "-name".
    custom_ops: list[str] = field(default_factory=list)
    # Padded token counts per step (None: powers of two up to max_num_batched_tokens, with
    # their 1.5x midpoints from 16 up).
    token_buckets: list[int] | None = None
    # Which programs are ready before the engine serves: "all"; "largest" (the largest
    # token bucket's, which holds any step, the rest compiled in the background);
    # "first-use" (none: the first step's bucket is compiled then, the rest in the
    # background); "used" (each bucket when a step first needs it, nothing in the
    # background: one-shot commands that exit after their prompt). Multi-host engines
    # always compile all first (every process must run the same buckets).
    startup_programs: str = "largest"
    # Save compiled programs for the next start (directory: XLM_COMPILATION_CACHE_DIR).
    enable_compilation_cache: bool = True

    def __post_init__(self) -> None:
        owner = "CompilationConfig"
        _require(
            isinstance(self.custom_ops, list | tuple),
            owner,
            "custom_ops",
            self.custom_ops,
            "a list of 'all', 'none', '+name', '-name'",
        )
        self.custom_ops = list(self.custom_ops)
        for entry in self.custom_ops:
            _require(
                isinstance(entry, str)
                and (entry in ("all", "none") or (len(entry) > 1 and entry[0] in "+-")),
                owner,
                "custom_ops",
                entry,
                "entries 'all', 'none', '+name' or '-name'",
            )
        _require(
            not ("all" in self.custom_ops and "none" in self.custom_ops),
            owner,
            "custom_ops",
            self.custom_ops,
            "'all' or 'none', not both",
        )
        _require(
            self.startup_programs in STARTUP_PROGRAMS,
            owner,
            "startup_programs",
            self.startup_programs,
            " or ".join(repr(m) for m in STARTUP_PROGRAMS),
        )
        for name in ("token_buckets",):
            buckets = getattr(self, name)
            if buckets is not None:
                _require(
                    len(buckets) > 0 and all(isinstance(b, int) and b > 0 for b in buckets),
                    owner,
                    name,
                    buckets,
                    "a non-empty list of positive integers",
                )
                setattr(self, name, sorted(set(buckets)))
