/*
 * cuda-checkpoint, as CRIU's CUDA plugin calls it, answered by the engine that runs the save
 * or the restore.
 *
 * CRIU's CUDA plugin (plugins/cuda in CRIU's source) drives the driver's checkpoint protocol
 * at the right moments of a dump and a restore: lock while the tree runs, checkpoint once
 * CRIU has seized it, restore and unlock before CRIU lets it run again. It does so by running
 * `cuda-checkpoint --action ACTION --pid PID` and friends. NVIDIA's binary initialises CUDA in
 * every run (seconds each, inside the kernel's pause); this stand-in instead forwards its
 * arguments over the Unix socket named by JUPYTER_GPU_SNAPSHOT_CUDA_BROKER to the engine,
 * which has the driver loaded already and answers in a millisecond or two (gpu/broker.py).
 *
 * Protocol: the arguments, each ended by a NUL byte, then end of input; the answer is the
 * exit status as decimal digits and a newline, then the text to print.
 *
 * Built by scripts/install-criu.sh beside the plugin: cc -O2 -o cuda-checkpoint this-file.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define BROKER_ENV "JUPYTER_GPU_SNAPSHOT_CUDA_BROKER"

/* The plugin checks for "--action" in the help text before it enables itself. */
static const char usage[] =
	"usage: cuda-checkpoint --action {lock|checkpoint|restore|unlock} --pid PID [--timeout MS]\n"
	"       cuda-checkpoint --get-state --pid PID\n"
	"       cuda-checkpoint --get-restore-tid --pid PID\n"
	"Forwards each request to the jupyter-gpu-snapshot engine named by " BROKER_ENV ".\n";

static int write_all(int fd, const char *buf, size_t len)
{
	while (len > 0) {
		ssize_t n = write(fd, buf, len);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		buf += n;
		len -= (size_t)n;
	}
	return 0;
}

int main(int argc, char **argv)
{
	const char *path = getenv(BROKER_ENV);
	struct sockaddr_un addr;
	char answer[4096];
	size_t got = 0;
	int fd, i;

	if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
		fputs(usage, stdout);
		return 0;
	}
	if (path == NULL || strlen(path) >= sizeof(addr.sun_path)) {
		fprintf(stderr, "cuda-checkpoint: %s is not set: only a save or restore of "
				"jupyter-gpu-snapshot can answer\n", BROKER_ENV);
		return 1;
	}
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		perror("cuda-checkpoint: socket");
		return 1;
	}
	memset(&addr, 0, sizeof(addr));
	addr.sun_family = AF_UNIX;
	strcpy(addr.sun_path, path);
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0) {
		fprintf(stderr, "cuda-checkpoint: cannot reach the engine at %s: %s\n", path,
			strerror(errno));
		return 1;
	}
	for (i = 1; i < argc; i++) {
		if (write_all(fd, argv[i], strlen(argv[i]) + 1) < 0) {
			perror("cuda-checkpoint: write");
			return 1;
		}
	}
	shutdown(fd, SHUT_WR);
	for (;;) {
		ssize_t n;
		if (got == sizeof(answer) - 1)
			break;
		n = read(fd, answer + got, sizeof(answer) - 1 - got);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		got += (size_t)n;
	}
	answer[got] = '\0';
	close(fd);

	char *text = strchr(answer, '\n');
	if (text == NULL) {
		fprintf(stderr, "cuda-checkpoint: the engine closed the connection without an answer\n");
		return 1;
	}
	*text++ = '\0';
	fputs(text, stdout);
	return atoi(answer);
}
