/* A static program for workspaces with nothing else in them (no shell, no C library).
 *
 *   testbin echo WORD...     the words, space-separated, then a newline
 *   testbin true             exit 0
 *   testbin exit N           exit N
 *   testbin cat              stdin to stdout until end of file
 *   testbin pwd              the working directory
 *   testbin tty              "tty" and the terminal's name when stdin is one, else "notty"
 *   testbin nofile           the soft RLIMIT_NOFILE
 *   testbin sleep SECONDS    sleep
 *   testbin daemon FILE      double fork: the grandchild (own session, stdio on /dev/null)
 *                            writes its pid into FILE and pauses forever; both parents exit 0
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static int daemonize(const char *file) {
    pid_t child = fork();
    if (child < 0) return 1;
    if (child > 0) {
        int status = 0;
        waitpid(child, &status, 0);
        return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    }
    setsid();
    pid_t grandchild = fork();
    if (grandchild < 0) _exit(1);
    if (grandchild > 0) _exit(0);
    int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
        dup2(null, 0);
        dup2(null, 1);
        dup2(null, 2);
    }
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", file);
    FILE *out = fopen(tmp, "w");
    if (out == NULL) _exit(1);
    fprintf(out, "%ld\n", (long)getpid());
    fclose(out);
    rename(tmp, file);
    for (;;) pause();
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    const char *what = argv[1];
    if (strcmp(what, "echo") == 0) {
        for (int i = 2; i < argc; i++) printf("%s%s", i > 2 ? " " : "", argv[i]);
        printf("\n");
        return 0;
    }
    if (strcmp(what, "true") == 0) return 0;
    if (strcmp(what, "exit") == 0 && argc > 2) return atoi(argv[2]);
    if (strcmp(what, "cat") == 0) {
        char buf[4096];
        ssize_t n;
        while ((n = read(0, buf, sizeof buf)) > 0) {
            if (write(1, buf, (size_t)n) != n) return 1;
        }
        return n < 0 ? 1 : 0;
    }
    if (strcmp(what, "pwd") == 0) {
        char buf[4096];
        if (getcwd(buf, sizeof buf) == NULL) return 1;
        printf("%s\n", buf);
        return 0;
    }
    if (strcmp(what, "tty") == 0) {
        if (isatty(0)) printf("tty %s\n", ttyname(0));
        else printf("notty\n");
        return 0;
    }
    if (strcmp(what, "nofile") == 0) {
        struct rlimit limit;
        if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1;
        printf("%llu\n", (unsigned long long)limit.rlim_cur);
        return 0;
    }
    if (strcmp(what, "sleep") == 0 && argc > 2) {
        sleep((unsigned)atoi(argv[2]));
        return 0;
    }
    if (strcmp(what, "daemon") == 0 && argc > 2) return daemonize(argv[2]);
    fprintf(stderr, "testbin: unknown command %s\n", what);
    return 2;
}
