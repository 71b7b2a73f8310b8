"""What is compiled for the host is kept per CPU."""

from specjax import runtime


def test_host_key_follows_the_cpu_model_and_its_instruction_sets(monkeypatch, tmp_path):
    seen = {}
    for name, text in {"avx512": "model name\t: Xeon\nflags\t\t: fpu sse2 avx2 avx512f\n",
                       "avx2": "model name\t: Xeon\nflags\t\t: fpu sse2 avx2\n",
                       "epyc": "model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2\n",
                       "two cores": "processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu sse2 avx2\n"
                                    "processor\t: 1\nmodel name\t: Xeon\nflags\t\t: fpu sse2 avx2\n"}.items():
        cpuinfo = tmp_path / name
        cpuinfo.write_text(text)
        real = runtime.Path
        monkeypatch.setattr(runtime, "Path", lambda p, c=cpuinfo: c if p == "/proc/cpuinfo" else real(p))
        seen[name] = runtime.host_key()
    assert len({seen["avx512"], seen["avx2"], seen["epyc"]}) == 3
    assert seen["two cores"] == seen["avx2"]  # per-core repeats do not change it


def test_cpu_flags_override_changes_the_key(monkeypatch):
    real = runtime.host_key()
    monkeypatch.setenv("SPECJAX_CPU_FLAGS", "fpu sse2")
    assert runtime.cpu_flags() == {"fpu", "sse2"}
    assert runtime.host_key() != real
