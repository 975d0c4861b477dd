#!/usr/bin/env python3
"""Sorts the ThreadSanitizer reports in a test's log.

Usage: tsan_triage.py LOG
Exit 0: every report in LOG is gRPC's own ("grpc-internal" below), and at
least one was found; 1: some report is not (or LOG has none).

Debian's gRPC, protobuf and libstdc++ are not instrumented, so TSan cannot
see the synchronization inside them. bazel/tsan.supp silences what they do
themselves (called_from_lib), but a std::string copied inside gRPC goes
through libstdc++ (whose interceptor calls cannot be silenced: that would
also hide std::condition_variable's waits from TSan), and TSan's unwinder
stops at libstdc++'s frames. Such a report has no frame of Ferry's in
either access, and both threads were started by gRPC: see
docs/developer-notes.md ("the cold CI at dec788e"). A report with a
Ferry frame in an access stack, or a thread Ferry started, is never one.
"""

import re
import sys

# Frames that carry no code of Ferry's: TSan's interceptors (in the test
# binary, by libc's names) and the uninstrumented libraries.
_INTERCEPTORS = re.compile(
    r"^(memcpy|memmove|memset|memcmp|strlen|malloc|calloc|realloc|free|"
    r"__interceptor_\w+)$")
_LIBRARIES = re.compile(
    r"\((libstdc\+\+\.so|libgrpc\S*\.so|libgpr\.so|libupb\.so|libabsl_\w+\.so|"
    r"libprotobuf\.so|libc\.so)[.\d]*\+0x")
_FRAME = re.compile(r"^    #\d+ (.*?) (\S+|<null>) \((\S+?)\+0x")
_ACCESS = re.compile(
    r"^  (Previous )?(atomic )?(read|write) of size \d+ at .* by (.*):$",
    re.IGNORECASE)
_THREAD = re.compile(
    r"^  Thread (T\d+)(?: '[^']*')? \(tid=\d+, \w+\) created by (.*) at:$")
# Sections that are not judged, only recognised, so that any other line
# (another thread's output interleaved into the report) is.
_OTHER_SECTION = re.compile(r"^  (Location is |Mutex M\d+ )")


def _frame_is_foreign(line):
  """Whether a stack line is an interceptor or a frame of a library."""
  if _LIBRARIES.search(line):
    return True
  m = _FRAME.match(line)
  return m is not None and _INTERCEPTORS.match(m.group(1)) is not None


def _reports(text):
  """The text of each report, from its WARNING to its closing rule."""
  out = []
  current = None
  for line in text.splitlines():
    if line.startswith("WARNING: ThreadSanitizer:"):
      current = [line]
    elif current is not None:
      if line.startswith("=================="):
        out.append(current)
        current = None
      else:
        current.append(line)
  if current is not None:
    out.append(current)  # Cut short: judged as it stands (never benign).
  return out


def classify(report):
  """Returns "grpc-internal" or the reason it is not.

  Strict: a line it does not recognise, a stack TSan could not restore,
  or a frame of an unknown section makes a report Ferry's to look at.
  """
  if "data race" not in report[0]:
    return "not a data race: " + report[0]
  if not any(l.startswith("SUMMARY:") for l in report):
    return "report cut short"
  section = None  # "access", "thread:Tn", "other"
  access_threads = []
  access_in_lib = []  # Per access stack: a frame in a library seen.
  thread_creators = {}
  for line in report[1:]:
    if not line.strip() or line.startswith("SUMMARY:"):
      section = None
      continue
    m = _ACCESS.match(line)
    if m:
      section = "access"
      t = re.fullmatch(r"thread (T\d+)", m.group(4))
      if t is None:
        return "an access by " + m.group(4)
      access_threads.append(t.group(1))
      access_in_lib.append(False)
      continue
    m = _THREAD.match(line)
    if m:
      section = "thread:" + m.group(1)
      thread_creators[m.group(1)] = []
      continue
    if _OTHER_SECTION.match(line):
      section = "other"
      continue
    if not _FRAME.match(line) or section is None:
      return "a line it cannot place: " + line.strip()
    if section == "access":
      if not _frame_is_foreign(line):
        return "a frame outside gRPC and libstdc++: " + line.strip()
      if _LIBRARIES.search(line):
        access_in_lib[-1] = True
    elif section.startswith("thread:"):
      thread_creators[section[len("thread:"):]].append(line)
  if len(access_threads) != 2 or not all(access_in_lib):
    # An interceptor alone says nothing of who called it.
    return "not two access stacks, each through a library"
  for t in access_threads:
    stack = thread_creators.get(t)
    if not stack or not any("grpc_core::Thread::Thread" in l for l in stack):
      return "thread %s was not started by gRPC" % t
  return "grpc-internal"


def main(argv):
  if len(argv) != 2:
    print("usage: tsan_triage.py LOG", file=sys.stderr)
    return 2
  with open(argv[1], errors="replace") as f:
    reports = _reports(f.read())
  if not reports:
    print("tsan_triage: no ThreadSanitizer report in " + argv[1])
    return 1
  verdict = 0
  for i, r in enumerate(reports):
    why = classify(r)
    print("tsan_triage: report %d: %s" % (i + 1, why))
    if why != "grpc-internal":
      verdict = 1
  return verdict


if __name__ == "__main__":
  sys.exit(main(sys.argv))
