// main() of the replay half of a ferry_fuzz_test (bazel/fuzz.bzl): runs
// every corpus file given on the command line through the fuzz target,
// then kMutations inputs made by mutating them (bit flips, truncation,
// splicing, random bytes, dictionary-free), with a fixed seed so a failure
// reproduces. It is not a coverage-guided fuzzer -- that is the
// `_fuzzer` binary under --config=fuzz -- but it keeps every target
// exercised, under every sanitizer, in every `bazel test`. A crash or a
// sanitizer report fails the test; the offending input is written to
// $TEST_UNDECLARED_OUTPUTS_DIR (or the working directory) first.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc,
                                                          char*** argv);

namespace {

constexpr int kDefaultMutations = 20000;
constexpr size_t kMaxInput = 1 << 16;

std::string current;  // The input being run, saved if the process dies.

char crash_path[4096];

// On a crash or a sanitizer abort: save the input, then die as before.
void OnFatalSignal(int sig) {
  const int fd = ::open(crash_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    ssize_t n = ::write(fd, current.data(), current.size());
    (void)n;
    ::close(fd);
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void Run(const std::string& input) {
  current = input;
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()),
                         input.size());
}

std::string Mutate(const std::vector<std::string>& seeds,
                   std::mt19937_64& rng) {
  std::string s = seeds.empty() ? std::string() : seeds[rng() % seeds.size()];
  const int steps = 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < steps; ++i) {
    switch (rng() % 7) {
      case 0:  // Flip a bit.
        if (!s.empty())
          s[rng() % s.size()] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 1:  // Set a byte to an interesting value.
        if (!s.empty()) {
          static const uint8_t kValues[] = {0, 1, 0x7f, 0x80, 0xff, 0x10, 0x40};
          s[rng() % s.size()] = static_cast<char>(kValues[rng() % 7]);
        }
        break;
      case 2:  // Truncate.
        if (!s.empty()) s.resize(rng() % s.size());
        break;
      case 3:  // Append random bytes.
        for (int k = static_cast<int>(rng() % 16); k > 0; --k) {
          s.push_back(static_cast<char>(rng()));
        }
        break;
      case 4:  // Splice with another seed.
        if (!seeds.empty()) {
          const std::string& o = seeds[rng() % seeds.size()];
          if (!o.empty()) s += o.substr(rng() % o.size());
        }
        break;
      case 5:  // Overwrite 8 bytes (a length or address field) at random.
        if (s.size() >= 8) {
          const size_t at = rng() % (s.size() - 7);
          uint64_t v = rng();
          if (rng() % 2) v = ~uint64_t{0} >> (rng() % 64);
          std::memcpy(&s[at], &v, 8);
        }
        break;
      default:  // Erase a range.
        if (s.size() > 1) {
          const size_t at = rng() % s.size();
          s.erase(at, rng() % (s.size() - at));
        }
    }
  }
  if (s.size() > kMaxInput) s.resize(kMaxInput);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  const char* dir = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR");
  std::snprintf(crash_path, sizeof(crash_path), "%s/crash-input",
                dir != nullptr ? dir : ".");
  for (int sig : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL}) {
    ::signal(sig, OnFatalSignal);
  }
  std::vector<std::string> seeds;
  int mutations = kDefaultMutations;
  for (int i = 1; i < argc; ++i) {
    const std::string path = argv[i];
    if (path.rfind("--mutations=", 0) == 0) {
      mutations = std::atoi(path.c_str() + 12);
      continue;
    }
    if (path.size() > 5 && path.compare(path.size() - 5, 5, ".dict") == 0) {
      continue;  // The dictionary is for libFuzzer.
    }
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "cannot read corpus file %s\n", path.c_str());
      return 2;
    }
    seeds.emplace_back(std::istreambuf_iterator<char>(in),
                       std::istreambuf_iterator<char>());
  }
  for (const std::string& s : seeds) Run(s);
  std::mt19937_64 rng(0x5eed);
  for (int i = 0; i < mutations; ++i) Run(Mutate(seeds, rng));
  std::printf("%zu corpus inputs and %d mutations ran\n", seeds.size(),
              mutations);
  return 0;
}
