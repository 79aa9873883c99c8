/*
 * Tiny timestamp helpers for bench/run, compiled at run time into the
 * benchmark's temp dir and dispatched on the basename of argv[0]:
 *
 *   stamp FILE              first thing: read CLOCK_MONOTONIC; write "<ns>\n" to FILE.
 *   stamp-wait FILE GOFILE  open FILE, wait (inotify, 60 s timeout) until GOFILE
 *                           exists, then read the clock, write "<ns>\n", _exit.
 *                           The clock read + one write(2) is the last thing the
 *                           lock holder's command does.
 *   stamp-append FILE       first thing: read the clock; append "$BENCH_TAG <ns>\n".
 *   contend N REQFILE GOFILE TAG PROG ARG...
 *                           wait for GOFILE, then N times: read the clock (the
 *                           "request" time), posix_spawn PROG ARG... with
 *                           BENCH_TAG=TAG.i in its environment, waitpid. At the
 *                           end write "TAG.i <req ns>" lines to REQFILE.
 *                           Exits 3 if any run failed.
 *
 * CLOCK_MONOTONIC is the clock Python's time.monotonic_ns() reads too.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <poll.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

static int exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

/* Waits until `path` exists: an inotify watch on its directory, re-checked
 * after the watch is in place, with a timeout. Returns 0, or -1 on timeout. */
static int wait_for_file(const char *path, int timeout_ms) {
    if (exists(path)) return 0;
    char dirbuf[4096];
    snprintf(dirbuf, sizeof dirbuf, "%s", path);
    const char *dir = dirname(dirbuf);
    int in = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    if (in >= 0 && inotify_add_watch(in, dir, IN_CREATE | IN_MOVED_TO | IN_ATTRIB) < 0) {
        close(in);
        in = -1;
    }
    long long deadline = now_ns() + (long long)timeout_ms * 1000000LL;
    for (;;) {
        if (exists(path)) break;
        long long left = (deadline - now_ns()) / 1000000LL;
        if (left <= 0) {
            if (in >= 0) close(in);
            return -1;
        }
        if (in >= 0) {
            struct pollfd p = {.fd = in, .events = POLLIN};
            /* Wake at least every 50 ms anyway, in case an event was missed. */
            poll(&p, 1, left < 50 ? (int)left : 50);
            char buf[4096];
            while (read(in, buf, sizeof buf) > 0) {
            }
        } else {
            usleep(1000);
        }
    }
    if (in >= 0) close(in);
    return 0;
}

static int do_stamp(int argc, char **argv) {
    long long t = now_ns();
    if (argc < 2) return 2;
    int fd = open(argv[1], O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return 2;
    char buf[32];
    int n = snprintf(buf, sizeof buf, "%lld\n", t);
    if (write_all(fd, buf, (size_t)n) < 0) return 2;
    close(fd);
    return 0;
}

static int do_stamp_wait(int argc, char **argv) {
    if (argc < 3) return 2;
    int fd = open(argv[1], O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return 2;
    if (wait_for_file(argv[2], 60000) < 0) return 4;
    long long t = now_ns();
    char buf[32];
    int n = snprintf(buf, sizeof buf, "%lld\n", t);
    if (write_all(fd, buf, (size_t)n) < 0) _exit(2);
    _exit(0); /* the kernel closes fd; nothing else runs after the stamp */
}

static int do_stamp_append(int argc, char **argv) {
    long long t = now_ns();
    if (argc < 2) return 2;
    const char *tag = getenv("BENCH_TAG");
    if (!tag) tag = "?";
    int fd = open(argv[1], O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return 2;
    char buf[256];
    int n = snprintf(buf, sizeof buf, "%s %lld\n", tag, t);
    if (write_all(fd, buf, (size_t)n) < 0) return 2;
    close(fd);
    return 0;
}

static int do_contend(int argc, char **argv) {
    if (argc < 6) return 2;
    int n = atoi(argv[1]);
    const char *reqfile = argv[2];
    const char *gofile = argv[3];
    const char *tag = argv[4];
    char **prog = &argv[5];
    if (n <= 0 || n > 100000) return 2;
    long long *req = calloc((size_t)n, sizeof *req);
    if (!req) return 2;
    if (wait_for_file(gofile, 60000) < 0) return 4;
    int failed = 0;
    char tagbuf[256];
    for (int i = 0; i < n; i++) {
        snprintf(tagbuf, sizeof tagbuf, "%s.%d", tag, i);
        setenv("BENCH_TAG", tagbuf, 1);
        req[i] = now_ns();
        pid_t pid;
        if (posix_spawn(&pid, prog[0], NULL, NULL, prog, environ) != 0) {
            failed++;
            continue;
        }
        int status;
        while (waitpid(pid, &status, 0) < 0) {
            if (errno != EINTR) {
                status = -1;
                break;
            }
        }
        if (status != 0) failed++;
    }
    int fd = open(reqfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return 2;
    for (int i = 0; i < n; i++) {
        char buf[300];
        int len = snprintf(buf, sizeof buf, "%s.%d %lld\n", tag, i, req[i]);
        write_all(fd, buf, (size_t)len);
    }
    close(fd);
    return failed ? 3 : 0;
}

int main(int argc, char **argv) {
    char namebuf[4096];
    snprintf(namebuf, sizeof namebuf, "%s", argv[0]);
    const char *name = basename(namebuf);
    if (strcmp(name, "stamp") == 0) return do_stamp(argc, argv);
    if (strcmp(name, "stamp-wait") == 0) return do_stamp_wait(argc, argv);
    if (strcmp(name, "stamp-append") == 0) return do_stamp_append(argc, argv);
    if (strcmp(name, "contend") == 0) return do_contend(argc, argv);
    fprintf(stderr, "stamp: unknown mode %s\n", name);
    return 2;
}
