#!/usr/bin/env python3
"""Writes the seed corpus of //transport/softrnic:wire_fuzz_test.

Each seed is a valid input as wire_fuzz.cc reads it: a flags byte, for the
requester side the work requests to post, then frames (40-byte headers in
wire.h's layout, and payloads). Zero QPN, aux and rkey fields and remote
addresses below 2**32 are replaced by the fuzz target with its QP's values.
Run from the repository root: transport/softrnic/fuzz/make_wire_corpus.py
"""
import os
import struct

HELLO, HELLO_ACK, SEND, SEND_IMM, WRITE, WRITE_IMM, READ = 1, 2, 10, 11, 12, 13, 14
ACK, NAK, READ_RESP = 20, 21, 22
NAK_ACCESS, NAK_INVALID, NAK_RNR, NAK_SEQ, NAK_NOQP, NAK_OP = 1, 2, 3, 4, 5, 6

FULL, NO_WRITE, NO_READ, LOCAL = 0, 1, 2, 3
RTS, RECVS, REQUESTER = 4, 8, 16


def frame(type_, msn=0, length=0, rkey=0, addr=0, imm=0, aux=0, qpn=0,
          flags=0, payload=b"", version=1, magic=b"SRNC"):
    return (magic + struct.pack(">BBHIIIIQII", version, type_, flags, qpn,
                                msn, length, rkey, addr, imm, aux) + payload)


def data(n, seed=1):
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


def wqes(*ops):
    """(opcode index, signaled, length/64) for wire_fuzz's requester."""
    out = bytes([len(ops)])
    for op, signaled, units in ops:
        out += bytes([op | (8 if signaled else 0), units >> 8, units & 0xFF])
    return out


seeds = {
    "responder_write_read_send": bytes([FULL | RTS | RECVS])
    + frame(HELLO)
    + frame(WRITE, 0, 256, addr=4096, payload=data(256))
    + frame(READ, 1, 128, addr=4096)
    + frame(SEND, 2, 64, payload=data(64, 2))
    + frame(WRITE_IMM, 3, 32, addr=0, imm=0xDEADBEEF, payload=data(32, 3))
    + frame(SEND_IMM, 4, 16, imm=7, flags=1, payload=data(16, 4)),
    "responder_rtr_only": bytes([FULL | RECVS])
    + frame(HELLO)
    + frame(WRITE, 0, 64, addr=0, payload=data(64)),
    "responder_no_rights": bytes([LOCAL | RTS | RECVS])
    + frame(HELLO)
    + frame(WRITE, 0, 64, addr=0, payload=data(64))
    + frame(READ, 1, 64, addr=0),
    "responder_out_of_bounds": bytes([FULL | RTS])
    + frame(HELLO)
    + frame(READ, 0, 4096, addr=65536 - 100)
    + frame(WRITE, 1, 64, addr=0xFFFFFFFFFFFFFFC0, payload=data(64)),
    "responder_rnr_and_sequence": bytes([FULL | RTS])
    + frame(HELLO)
    + frame(SEND, 0, 8, payload=data(8))
    + frame(WRITE, 5, 8, addr=0, payload=data(8))
    + frame(WRITE, 0, 8, addr=0, payload=data(8))
    + frame(READ, 0, 8, addr=0),
    "responder_send_too_long": bytes([FULL | RTS | RECVS])
    + frame(HELLO)
    + frame(SEND, 0, 20000, payload=data(20000)),
    "responder_truncated_payload": bytes([NO_READ | RTS])
    + frame(HELLO)
    + frame(WRITE, 0, 1000, addr=0, payload=data(100)),
    "responder_bad_hello": bytes([FULL | RTS])
    + frame(HELLO, aux=0x42)
    + frame(WRITE, 0, 8, payload=data(8)),
    "responder_not_a_request": bytes([FULL | RTS])
    + frame(HELLO)
    + frame(ACK, 0),
    "requester_acks": bytes([FULL | REQUESTER | (7 << 5)])
    + wqes((0, True, 4), (1, True, 2), (2, False, 1), (0, True, 1))
    + frame(ACK, 0)
    + frame(READ_RESP, 1, 128, payload=data(128))
    + frame(ACK, 3),
    "requester_naks": bytes([FULL | REQUESTER | (1 << 5)])
    + wqes((2, True, 1), (0, True, 1), (1, True, 1))
    + frame(NAK, 0, aux=NAK_RNR, rkey=1)
    + frame(NAK, 0, aux=NAK_SEQ)
    + frame(NAK, 1, aux=NAK_ACCESS)
    + frame(NAK, 2, aux=NAK_OP),
    "requester_bad_read_response": bytes([FULL | REQUESTER])
    + wqes((1, True, 4))
    + frame(READ_RESP, 0, 100, payload=data(100))
    + frame(READ_RESP, 0, 256, payload=data(256)),
    "requester_noqp": bytes([FULL | REQUESTER])
    + wqes((4, True, 1), (3, True, 1))
    + frame(HELLO_ACK)
    + frame(NAK, 0, aux=NAK_INVALID)
    + frame(NAK, 1, aux=NAK_NOQP),
}

out = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                   "wire_fuzz_test_corpus")
os.makedirs(out, exist_ok=True)
for name, blob in seeds.items():
    with open(os.path.join(out, name), "wb") as f:
        f.write(blob)
print("wrote %d seeds to %s" % (len(seeds), out))
