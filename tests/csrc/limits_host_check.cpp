// Host build of csrc/portability.h's arch table: prints "<arch> <max_rows> <staging_elements> <block_bytes>"
// for every arch name given on the command line, through the same lookup the torch binding uses (block_bytes:
// the staging at the budget plus the shared memory the kernel reserves besides it).
#include <cstdio>

#include "portability.h"

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const w4a16::ArchId id = w4a16::arch_id_from_name(argv[i]);
    const w4a16::ArchLimits l = w4a16::arch_limits(id);
    std::printf("%s %d %d %d\n", argv[i], l.max_rows, l.staging_elements,
                w4a16::staging_bytes(l.staging_elements) + w4a16::reserved_bytes(id));
  }
  return 0;
}
