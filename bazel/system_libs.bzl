"""Exposes Debian's system C++ libraries as linkopts-only cc_library targets.

Headers live in /usr/include, a builtin include directory of the autoconfigured
gcc toolchain, so only link flags are needed. They come from pkg-config at
fetch time, which stays correct when Debian's abseil splits or merges libraries.
"""

_LIBS = {
    "absl": [
        "absl_base",
        "absl_flags",
        "absl_flags_parse",
        "absl_flat_hash_map",
        "absl_hash",
        "absl_random_random",
        "absl_status",
        "absl_statusor",
        "absl_str_format",
        "absl_strings",
        "absl_synchronization",
        "absl_time",
    ],
    "benchmark": ["benchmark"],
    "crypto": ["libcrypto"],
    "gmock": ["gmock"],
    "grpc": ["grpc++"],
    "gtest": ["gtest"],
    "ibverbs": ["libibverbs"],
    "protobuf": ["protobuf"],
    "spdlog": ["spdlog"],
}

def _system_libs_impl(rctx):
    pkg_config = rctx.which("pkg-config")
    if pkg_config == None:
        fail("pkg-config not found: run tools/dev.sh setup")
    build = []
    for name in sorted(_LIBS.keys()):
        modules = _LIBS[name]
        res = rctx.execute([pkg_config, "--libs"] + modules)
        if res.return_code != 0:
            fail("pkg-config --libs %s failed: %s (run tools/dev.sh setup)" %
                 (" ".join(modules), res.stderr))
        flags = [f for f in res.stdout.strip().split(" ") if f]
        # Macros a library's headers need (spdlog: SPDLOG_COMPILED_LIB,
        # SPDLOG_FMT_EXTERNAL); include paths are builtin.
        cflags = rctx.execute([pkg_config, "--cflags-only-other"] + modules)
        defines = [f[2:] for f in cflags.stdout.strip().split(" ") if f.startswith("-D")]
        build.append(
            "cc_library(\n    name = \"%s\",\n    linkopts = %s,\n" % (name, repr(flags)) +
            "    defines = %s,\n" % repr(defines) +
            "    visibility = [\"//visibility:public\"],\n)\n",
        )
    # Python's C headers for extension modules (the python package):
    # /usr/include/python3.X is not a builtin include directory, and a
    # cc_library may only name include paths inside its repository, so the
    # directory is linked in here.
    py = rctx.execute([pkg_config, "--cflags-only-I", "python3"])
    py_dirs = [f[2:] for f in py.stdout.strip().split(" ") if f.startswith("-I")]
    if py.return_code == 0 and py_dirs:
        rctx.symlink(py_dirs[0], "python3")
        build.append(
            "cc_library(\n    name = \"python_headers\",\n" +
            "    hdrs = glob([\"python3/**/*.h\"]),\n" +
            "    includes = [\"python3\"],\n" +
            "    visibility = [\"//visibility:public\"],\n)\n",
        )
    rctx.file("WORKSPACE", "workspace(name = \"system\")\n")
    rctx.file("BUILD", "\n".join(build))

system_libs = repository_rule(
    implementation = _system_libs_impl,
    local = True,
)
