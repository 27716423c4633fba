/* How much a first touch of anonymous memory costs on this machine, with
 * and without transparent huge pages, and how that depends on how long ago
 * the memory was freed (a VM guest with free page reporting hands free
 * pages back to its host, and getting them back is slow).
 *
 *   cc -O2 -o /tmp/fault_cost bench/scale/fault_cost.c
 *   /tmp/fault_cost MIB HUGE [PAUSE_SECONDS]
 *
 * maps MIB MiB three times in a row (advised MADV_HUGEPAGE when HUGE is 1),
 * touches one byte per 4 KiB page, times that, then a memset of the
 * already-faulted memory, and unmaps it; PAUSE_SECONDS (default 0) is slept
 * between the rounds. Not part of the build. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s MIB HUGE(0|1) [PAUSE_SECONDS]\n", argv[0]);
    return 2;
  }
  const size_t n = (size_t)atol(argv[1]) << 20;
  const int huge = atoi(argv[2]);
  const unsigned pause = argc > 3 ? (unsigned)atoi(argv[3]) : 0;
  for (int round = 0; round < 3; ++round) {
    if (round > 0 && pause > 0) sleep(pause);
    char* p = mmap(NULL, n, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      perror("mmap");
      return 1;
    }
    if (huge) madvise(p, n, MADV_HUGEPAGE);
    double t = now();
    for (size_t i = 0; i < n; i += 4096) p[i] = 1;
    const double fault = now() - t;
    t = now();
    memset(p, 2, n);
    const double set = now() - t;
    munmap(p, n);
    printf("round %d: %zu MiB, huge pages %s: first touch %.3f s (%.2f GB/s), "
           "memset after %.3f s (%.2f GB/s)\n",
           round + 1, n >> 20, huge ? "advised" : "no", fault, n / fault / 1e9,
           set, n / set / 1e9);
  }
  return 0;
}
