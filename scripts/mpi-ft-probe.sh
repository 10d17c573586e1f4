#!/usr/bin/env bash
# Probes what the installed MPI offers for replica fail/heal (docs/distributed.md, "Replica failure"):
#  1. dynamic processes: can a job open a port (MPI_Open_port) and spawn (MPI_Comm_spawn)?
#     Without them a restarted replica cannot join running ones.
#  2. a dead peer: in one 4-rank job that Hydra leaves running when a rank dies
#     (-disable-auto-cleanup), does an all-reduce with the dead rank return an error
#     (MPI_ERRORS_RETURN) or hang? Without an error the survivors cannot go on by themselves.
# Usage: bash scripts/mpi-ft-probe.sh   (needs mpicc and mpiexec; about a minute)
set -u
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/port.c" <<'C'
#include <mpi.h>
#include <stdio.h>
/* MPICH's error strings span lines: one line each here. */
static const char *flat(char *s) {
  for (char *c = s; *c; c++)
    if (*c == '\n') *c = ' ';
  return s;
}
int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
  char port[MPI_MAX_PORT_NAME], s[MPI_MAX_ERROR_STRING];
  int len, rc = MPI_Open_port(MPI_INFO_NULL, port);
  MPI_Error_string(rc, s, &len);
  printf("MPI_Open_port: %s\n", rc == MPI_SUCCESS ? "works" : flat(s));
  MPI_Comm child;
  rc = MPI_Comm_spawn("/bin/true", MPI_ARGV_NULL, 1, MPI_INFO_NULL, 0, MPI_COMM_SELF, &child,
                      MPI_ERRCODES_IGNORE);
  MPI_Error_string(rc, s, &len);
  printf("MPI_Comm_spawn: %s\n", rc == MPI_SUCCESS ? "works" : flat(s));
  MPI_Finalize();
  return 0;
}
C
cat >"$dir/dead.c" <<'C'
#include <mpi.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  for (int i = 0; i < 20; i++) {
    if (rank == 3 && i == 5) _exit(1);
    double x = 1, y = 0;
    int rc = MPI_Allreduce(&x, &y, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) {
      printf("rank %d: the all-reduce with a dead rank returned an error\n", rank);
      fflush(stdout);
      _exit(0);
    }
    usleep(100000);
  }
  MPI_Finalize();
  return 0;
}
C
mpicc -o "$dir/port" "$dir/port.c" && mpicc -o "$dir/dead" "$dir/dead.c" || exit 1
timeout 30 mpiexec -n 1 "$dir/port" 2>&1 | grep -E "^MPI_"
out=$(timeout 30 mpiexec -disable-auto-cleanup -n 4 "$dir/dead" 2>/dev/null)
if grep -q "returned an error" <<<"$out"; then
  echo "dead peer: the survivors get an error ($(grep -c 'returned an error' <<<"$out") of 3)"
else
  echo "dead peer: the survivors hang (no error within 30 s)"
fi
