// One planted bug of each kind the combined sanitizer build (--config=
// sanitize: ASan and UBSan in one binary) must still catch, run by
// sanitizer_check_test.sh. Sizes and values come from the command line so
// that the compiler cannot fold the bugs away.
//
//   planted_bugs heap-overflow N    reads one byte past a new char[N]
//   planted_bugs signed-overflow N  adds 1 to INT_MAX - 1 + N
//   planted_bugs none N             does neither
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr,
                 "usage: planted_bugs heap-overflow|signed-overflow|none N\n");
    return 2;
  }
  const int n = std::atoi(argv[2]);
  if (std::strcmp(argv[1], "heap-overflow") == 0) {
    char* p = new char[n];
    std::memset(p, 1, n);
    const int past = p[n];  // One byte past the allocation.
    delete[] p;
    std::printf("read %d past the end: not caught\n", past);
  } else if (std::strcmp(argv[1], "signed-overflow") == 0) {
    int x = INT_MAX - 1 + n;
    x += 1;  // Overflows for n >= 1.
    std::printf("%d: not caught\n", x);
  } else if (std::strcmp(argv[1], "none") != 0) {
    std::fprintf(stderr, "unknown bug %s\n", argv[1]);
    return 2;
  }
  return 0;
}
