"""ferry_fuzz_test: one fuzz target, two ways to run it.

- `<name>` is a cc_test that replays the seed corpus through the target and
  then runs a bounded number of mutations of it (common/fuzz/replay_main.cc),
  so every build (gcc, ASan, UBSan, TSan) exercises it in `bazel test`.
- `<name>_fuzzer` is the libFuzzer binary (tagged manual and fuzzer): build
  it with --config=fuzz (clang, ASan, -fsanitize=fuzzer) and run it with
  the corpus directory and the dictionary, as tools/dev.sh fuzz does.

The source defines `extern "C" int LLVMFuzzerTestOneInput(const uint8_t*,
size_t)`. The corpus is the files under `<corpus>/` (default
`fuzz/<name>_corpus`), the dictionary `dict` (optional); `mutations` bounds
the replay test's random inputs (fewer for targets that do real I/O).
"""

def ferry_fuzz_test(name, srcs, deps = [], corpus = None, dict = None, size = "small", mutations = 20000, **kwargs):
    corpus = corpus or "fuzz/%s_corpus" % name
    corpus_files = native.glob([corpus + "/**"])
    native.filegroup(
        name = name + "_corpus",
        srcs = corpus_files + ([dict] if dict else []),
    )
    native.cc_test(
        name = name,
        size = size,
        srcs = srcs,
        deps = deps + ["//common/fuzz:replay_main"],
        data = [":" + name + "_corpus"],
        args = ["--mutations=%d" % mutations, "$(locations :%s_corpus)" % name],
        **kwargs
    )
    native.cc_binary(
        name = name + "_fuzzer",
        srcs = srcs,
        deps = deps,
        linkopts = ["-fsanitize=fuzzer"],
        tags = ["manual", "fuzzer"],
        **kwargs
    )
