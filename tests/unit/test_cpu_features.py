"""engine/cpu_features.py: the CPU's x86 flags read from /proc/cpuinfo's text, whole flags only
(none on ARM, which lists "Features")."""
from engine.cpu_features import cpu_flags


def test_flags_are_read_whole_on_x86_and_arm():
    epyc_avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\nbugs\t\t: sysret_ss_attrs\n"
    epyc_avx512 = "processor\t: 0\nflags\t\t: fpu avx2 fma avx512f avx512dq avx512_bf16\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes\n"
    assert {"avx2", "fma"} <= cpu_flags(epyc_avx2) and "avx512f" not in cpu_flags(epyc_avx2)
    assert "sysret_ss_attrs" not in cpu_flags(epyc_avx2)          # the bugs line is not flags
    assert {"avx512f", "avx512_bf16"} <= cpu_flags(epyc_avx512)
    assert cpu_flags(arm) == frozenset()
    assert "avx512f" not in cpu_flags("flags\t\t: avx512fx\n")   # a whole flag, not a prefix
    assert cpu_flags("") == frozenset()
