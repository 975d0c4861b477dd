"""Finds etcd's gRPC .proto files, which Debian ships for Go.

golang-etcd-server-dev installs them under /usr/share/gocode/src, but it
depends on about 130 Go source packages the C++ build never reads (half of a
fresh machine's set-up time), so tools/dev.sh extracts that one package's
.proto files from Debian's archive into /usr/local/share/ferry/etcd-proto
instead (apt-get download; nothing outside Debian is fetched, and nothing of
etcd's is kept in this tree). Either place serves; the installed package wins.
"""

_SUBDIR = "share/gocode/src/go.etcd.io/etcd"
_ROOTS = [
    "/usr/" + _SUBDIR,
    "/usr/local/share/ferry/etcd-proto/usr/" + _SUBDIR,
]
_FILES = {
    "rpc.proto": "etcdserver/etcdserverpb/rpc.proto",
    "kv.proto": "mvcc/mvccpb/kv.proto",
    "auth.proto": "auth/authpb/auth.proto",
}

def _etcd_proto_impl(rctx):
    for root in _ROOTS:
        if all([rctx.path(root + "/" + f).exists for f in _FILES.values()]):
            for name, f in _FILES.items():
                rctx.symlink(root + "/" + f, name)
            rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)
            rctx.file("BUILD", "exports_files(%s)\n" % repr(sorted(_FILES.keys())))
            return
    fail("etcd's .proto files (%s) are in none of %s: run tools/dev.sh setup, " %
         (", ".join(sorted(_FILES.values())), ", ".join(_ROOTS)) +
         "which extracts them from Debian's golang-etcd-server-dev")

etcd_proto = repository_rule(
    implementation = _etcd_proto_impl,
    local = True,
)
