/*
 * A process whose memory criu must bring back exactly (scripts/criu-fill-check.sh).
 *
 *   criu-fill-check DIR MIB
 *
 * Maps MIB MiB of private memory and fills it with a pattern that differs on every 8
 * bytes, leaving every seventh page untouched (criu dumps no page for those, and a
 * restore must leave them zeros). Writes the digest of the whole mapping to DIR/before,
 * then waits. On SIGUSR1 it writes the digest again, to DIR/after, and exits: a restored
 * copy whose memory came back whole writes the same digest.
 */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PAGE 4096

static uint64_t *memory;
static size_t words;

static uint64_t mix(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ULL;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
	return x ^ (x >> 31);
}

static uint64_t digest(void)
{
	uint64_t h = 0;

	for (size_t i = 0; i < words; i++)
		h = mix(h ^ memory[i]);
	return h;
}

/* Written whole under another name, then renamed: a reader never sees half of it. */
static int write_digest(const char *dir, const char *name)
{
	char tmp[4096], path[4096];
	FILE *f;

	snprintf(tmp, sizeof(tmp), "%s/%s.tmp", dir, name);
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	f = fopen(tmp, "w");
	if (!f)
		return -1;
	fprintf(f, "%016llx\n", (unsigned long long)digest());
	if (fclose(f))
		return -1;
	return rename(tmp, path);
}

int main(int argc, char **argv)
{
	size_t bytes, per_page = PAGE / sizeof(uint64_t);
	sigset_t usr1, old;
	int sig;

	if (argc != 3)
		return 2;
	/* Nothing inherited is dumped: a file locked by whoever started us would fail it. */
	syscall(SYS_close_range, 3, ~0U, 0);
	bytes = (size_t)atol(argv[2]) << 20;
	memory = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (memory == MAP_FAILED)
		return 1;
	words = bytes / sizeof(uint64_t);
	for (size_t page = 0; page < bytes / PAGE; page++) {
		if (page % 7 == 3)
			continue;
		for (size_t w = 0; w < per_page; w++)
			memory[page * per_page + w] = mix(page * per_page + w);
	}
	/* Blocked before the first digest is written: a SIGUSR1 sent once it is there waits. */
	sigemptyset(&usr1);
	sigaddset(&usr1, SIGUSR1);
	if (sigprocmask(SIG_BLOCK, &usr1, &old))
		return 1;
	if (write_digest(argv[1], "before"))
		return 1;
	if (sigwait(&usr1, &sig))
		return 1;
	return write_digest(argv[1], "after") ? 1 : 0;
}
