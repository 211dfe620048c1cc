/*
 * FUSE passthrough for pyfuse3 on libfuse 3.14.
 *
 * Why this exists: the kernel (6.9+) can send read/write/mmap of an open file
 * straight to a "backing" file on the local tier, so checkpoint bytes never
 * cross /dev/fuse or the Python daemon.  libfuse 3.14 and pyfuse3 cannot ask
 * for it, but the protocol is small: the INIT reply carries FUSE_PASSTHROUGH and
 * a stack depth, and an OPEN/CREATE reply carries FOPEN_PASSTHROUGH and a
 * backing id registered with the FUSE_DEV_IOC_BACKING_OPEN ioctl.
 *
 * This module interposes fuse_session_mount() (it is loaded RTLD_GLOBAL before
 * pyfuse3, see burstfs/passthrough.py) to install libfuse's custom I/O hooks on
 * the session.  The read hook notes INIT, OPEN and CREATE requests; the writev
 * hook amends exactly those replies.  Nothing else in a request or reply is
 * touched, and with nothing requested both hooks are plain read/writev.
 *
 * It can also ask for FUSE_HANDLE_KILLPRIV_V2, which tells the kernel that the
 * server clears setuid/setgid bits itself (burstfs never stores them on files)
 * and lets it mark inodes S_NOSEC: without it every write(2) first sends a
 * GETXATTR of security.capability to the daemon.
 *
 * fallocate(2): pyfuse3 3.5 has no FALLOCATE handler (libfuse answers ENOSYS
 * and the kernel then refuses every later fallocate with EOPNOTSUPP).  Once
 * enable_fallocate(token) was called, the read hook turns a FALLOCATE request
 * into a SETXATTR request of the reserved name "burstfs.fallocate" on the same
 * inode, whose value carries a 16-byte token and the request's fh, offset,
 * length and mode: pyfuse3 hands it to the daemon's setxattr on the request
 * loop, in order with the file's other requests, and the daemon's reply (a bare
 * error code) is exactly what FALLOCATE expects.  The token is random per
 * daemon, so a setxattr(2) from a user can never pass for a fallocate.
 *
 * GETXATTR outside "user.": burstfs stores only user.* attributes, so every
 * other name (security.capability, which the kernel asks for before the first
 * write of every file, posix ACLs, selinux labels) is ENODATA.  Once
 * answer_foreign_xattrs() was called, the read hook writes that reply itself
 * and hands libfuse an EINTR (pyfuse3 then waits for the next request): a
 * small file's create-write-close costs one Python request less.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define FUSE_USE_VERSION 312
#include <fuse_lowlevel.h>

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

/* Kernel protocol (include/uapi/linux/fuse.h), stable ABI. */
#define OP_OPEN 14
#define OP_SETXATTR 21
#define OP_GETXATTR 22
#define OP_FALLOCATE 43
#define OP_INIT 26
#define OP_CREATE 35
#define INIT_EXT (1u << 30)
#define INIT_WRITEBACK_CACHE (1u << 16)
#define INIT_HANDLE_KILLPRIV_V2 (1u << 28)
#define INIT2_PASSTHROUGH (1u << 5) /* FUSE_PASSTHROUGH is bit 37: flags2 bit 5 */
#define FOPEN_PASSTHROUGH_FLAG (1u << 7)

struct in_header {
    uint32_t len, opcode;
    uint64_t unique, nodeid;
    uint32_t uid, gid, pid;
    uint16_t total_extlen, padding;
};
struct init_in {
    uint32_t major, minor, max_readahead, flags, flags2;
};
struct out_header {
    uint32_t len;
    int32_t error;
    uint64_t unique;
};
struct init_out {
    uint32_t major, minor, max_readahead, flags;
    uint16_t max_background, congestion_threshold;
    uint32_t max_write, time_gran;
    uint16_t max_pages, map_alignment;
    uint32_t flags2, max_stack_depth;
    uint16_t request_timeout, unused[11];
};
struct open_out {
    uint64_t fh;
    uint32_t open_flags;
    int32_t backing_id;
};
#define ENTRY_OUT_SIZE 128
struct fallocate_in {
    uint64_t fh, offset, length;
    uint32_t mode, padding;
};
struct getxattr_in {
    uint32_t size, padding;
};
/* FUSE_COMPAT_SETXATTR_IN_SIZE: pyfuse3 does not ask for FUSE_SETXATTR_EXT. */
struct setxattr_in {
    uint32_t size, flags;
};
#define FALLOCATE_TOKEN_SIZE 16
static const char fallocate_name[] = "burstfs.fallocate";

#define MAX_PENDING 4096

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int requested_depth;     /* 0: passthrough not wanted */
static int requested_nosec;     /* ask for FUSE_HANDLE_KILLPRIV_V2 */
static uint32_t kernel_flags;   /* flags of the INIT request */
static int hooked_fd = -1;      /* /dev/fuse of the session we hooked */
static int kernel_offers;       /* INIT request advertised FUSE_PASSTHROUGH */
static int negotiated;          /* our INIT reply enabled it */
static uint64_t init_unique;
static int fallocate_enabled;
static unsigned char fallocate_token[FALLOCATE_TOKEN_SIZE];
static int foreign_xattrs_enabled;
static uint64_t foreign_xattrs_answered;

/* OPEN/CREATE requests awaiting a reply: unique -> opcode. */
static struct { uint64_t unique; uint32_t opcode; } pending_ops[MAX_PENDING];
static int n_pending_ops;

/* Backing ids the daemon attached to file handles, consumed by the open reply. */
static struct { uint64_t fh; int32_t backing_id; } attached[MAX_PENDING];
static int n_attached;

static int take_pending_op(uint64_t unique) {
    for (int i = 0; i < n_pending_ops; i++) {
        if (pending_ops[i].unique == unique) {
            int opcode = (int)pending_ops[i].opcode;
            pending_ops[i] = pending_ops[--n_pending_ops];
            return opcode;
        }
    }
    return 0;
}

static int32_t take_attached(uint64_t fh) {
    for (int i = 0; i < n_attached; i++) {
        if (attached[i].fh == fh) {
            int32_t id = attached[i].backing_id;
            attached[i] = attached[--n_attached];
            return id;
        }
    }
    return 0;
}

/* Rewrite a FALLOCATE request in buf (res bytes) into the SETXATTR described above;
 * returns its new length, or res if it stays as it is. */
static ssize_t fallocate_as_setxattr(void *buf, size_t cap, ssize_t res) {
    struct in_header *in = buf;
    struct fallocate_in request;
    size_t value_size = FALLOCATE_TOKEN_SIZE + sizeof request;
    size_t total = sizeof *in + sizeof(struct setxattr_in) + sizeof fallocate_name + value_size;
    if (res < (ssize_t)(sizeof *in + sizeof request) || total > cap)
        return res;
    memcpy(&request, (char *)buf + sizeof *in, sizeof request);
    char *at = (char *)buf + sizeof *in;
    struct setxattr_in header = {.size = (uint32_t)value_size, .flags = 0};
    memcpy(at, &header, sizeof header);
    at += sizeof header;
    memcpy(at, fallocate_name, sizeof fallocate_name);
    at += sizeof fallocate_name;
    memcpy(at, fallocate_token, FALLOCATE_TOKEN_SIZE);
    memcpy(at + FALLOCATE_TOKEN_SIZE, &request, sizeof request);
    in->opcode = OP_SETXATTR;
    in->len = (uint32_t)total;
    in->total_extlen = 0;
    return (ssize_t)total;
}

/* A GETXATTR request in buf (res bytes) of a name outside "user." (see the top). */
static int is_foreign_getxattr(const void *buf, ssize_t res) {
    static const char user[] = "user.";
    const struct in_header *in = buf;
    size_t at = sizeof *in + sizeof(struct getxattr_in);
    if (in->opcode != OP_GETXATTR || res < (ssize_t)(at + 1) || in->len != (uint32_t)res)
        return 0;
    const char *name = (const char *)buf + at;
    size_t room = (size_t)res - at;
    if (memchr(name, 0, room) == NULL)
        return 0; /* malformed: libfuse answers it */
    return strncmp(name, user, sizeof user - 1) != 0;
}

static ssize_t hook_read(int fd, void *buf, size_t len, void *userdata) {
    (void)userdata;
    ssize_t res = read(fd, buf, len);
    if (res < (ssize_t)sizeof(struct in_header))
        return res;
    int saved = errno;
    if (((struct in_header *)buf)->opcode == OP_GETXATTR) {
        pthread_mutex_lock(&lock);
        int answer = foreign_xattrs_enabled && is_foreign_getxattr(buf, res);
        if (answer)
            foreign_xattrs_answered++;
        pthread_mutex_unlock(&lock);
        if (answer) {
            struct out_header reply = {
                .len = sizeof reply, .error = -ENODATA, .unique = ((struct in_header *)buf)->unique};
            (void)!write(fd, &reply, sizeof reply); /* ENOENT: the caller gave up; nothing to do */
            errno = EINTR; /* no request for libfuse: pyfuse3 waits for the next one */
            return -1;
        }
        errno = saved;
        return res;
    }
    if (((struct in_header *)buf)->opcode == OP_FALLOCATE) {
        pthread_mutex_lock(&lock);
        int enabled = fallocate_enabled;
        pthread_mutex_unlock(&lock);
        errno = saved;
        return enabled ? fallocate_as_setxattr(buf, len, res) : res;
    }
    const struct in_header *in = buf;
    pthread_mutex_lock(&lock);
    if (in->opcode == OP_INIT && res >= (ssize_t)(sizeof *in + sizeof(struct init_in))) {
        const struct init_in *init = (const void *)((const char *)buf + sizeof *in);
        init_unique = in->unique;
        kernel_flags = init->flags;
        kernel_offers = (init->flags & INIT_EXT) && (init->flags2 & INIT2_PASSTHROUGH);
    } else if ((in->opcode == OP_OPEN || in->opcode == OP_CREATE) && requested_depth &&
               negotiated && n_pending_ops < MAX_PENDING) {
        pending_ops[n_pending_ops].unique = in->unique;
        pending_ops[n_pending_ops].opcode = in->opcode;
        n_pending_ops++;
    }
    pthread_mutex_unlock(&lock);
    errno = saved;
    return res;
}

/* Copy the reply payload (iov[1..]) into buf; returns its length or -1. */
static ssize_t gather(struct iovec *iov, int count, char *buf, size_t cap) {
    size_t n = 0;
    for (int i = 1; i < count; i++) {
        if (n + iov[i].iov_len > cap)
            return -1;
        memcpy(buf + n, iov[i].iov_base, iov[i].iov_len);
        n += iov[i].iov_len;
    }
    return (ssize_t)n;
}

static ssize_t hook_writev(int fd, struct iovec *iov, int count, void *userdata) {
    (void)userdata;
    if (count < 2 || iov[0].iov_len < sizeof(struct out_header))
        return writev(fd, iov, count);
    const struct out_header *out = iov[0].iov_base;
    char payload[ENTRY_OUT_SIZE + sizeof(struct open_out)];
    struct iovec amended[2] = {iov[0], {payload, 0}};

    pthread_mutex_lock(&lock);
    if (out->unique == init_unique && init_unique != 0) {
        init_unique = 0;
        ssize_t n = gather(iov, count, payload, sizeof payload);
        if (n >= (ssize_t)sizeof(struct init_out) && out->error == 0) {
            struct init_out *init = (struct init_out *)payload;
            /* the kernel refuses passthrough together with the writeback cache */
            if (requested_depth && kernel_offers && !(init->flags & INIT_WRITEBACK_CACHE)) {
                init->flags |= INIT_EXT;
                init->flags2 |= INIT2_PASSTHROUGH;
                init->max_stack_depth = (uint32_t)requested_depth;
                negotiated = 1;
                amended[1].iov_len = (size_t)n;
            }
            if (requested_nosec && (kernel_flags & INIT_HANDLE_KILLPRIV_V2)) {
                init->flags |= INIT_HANDLE_KILLPRIV_V2;
                amended[1].iov_len = (size_t)n;
            }
        }
    } else if (n_pending_ops && out->unique != 0) {
        int opcode = take_pending_op(out->unique);
        if (opcode && out->error == 0) {
            size_t at = opcode == OP_CREATE ? ENTRY_OUT_SIZE : 0;
            ssize_t n = gather(iov, count, payload, sizeof payload);
            if (n == (ssize_t)(at + sizeof(struct open_out))) {
                struct open_out *open = (struct open_out *)(payload + at);
                int32_t id = take_attached(open->fh);
                if (id > 0) {
                    open->backing_id = id;
                    open->open_flags |= FOPEN_PASSTHROUGH_FLAG;
                    amended[1].iov_len = (size_t)n;
                }
            }
        }
    }
    pthread_mutex_unlock(&lock);
    if (amended[1].iov_len)
        return writev(fd, amended, 2);
    return writev(fd, iov, count);
}

static const struct fuse_custom_io hooks = {
    .writev = hook_writev,
    .read = hook_read,
};

/* Interposed: pyfuse3.init() calls this right after fuse_session_new(). */
int fuse_session_mount(struct fuse_session *se, const char *mountpoint) {
    static int (*real_mount)(struct fuse_session *, const char *);
    if (real_mount == NULL)
        real_mount = (int (*)(struct fuse_session *, const char *))dlsym(RTLD_NEXT, "fuse_session_mount");
    if (real_mount == NULL)
        return -1;
    int res = real_mount(se, mountpoint);
    if (res != 0)
        return res;
    pthread_mutex_lock(&lock);
    kernel_offers = negotiated = 0;
    n_pending_ops = n_attached = 0;
    init_unique = 0;
    pthread_mutex_unlock(&lock);
    int fd = fuse_session_fd(se);
    if (fuse_session_custom_io(se, &hooks, fd) == 0)
        hooked_fd = fd;
    return 0;
}

static PyObject *py_request(PyObject *self, PyObject *args) {
    int depth, nosec;
    if (!PyArg_ParseTuple(args, "ip", &depth, &nosec))
        return NULL;
    pthread_mutex_lock(&lock);
    requested_depth = depth;
    requested_nosec = nosec;
    pthread_mutex_unlock(&lock);
    Py_RETURN_NONE;
}

static PyObject *py_state(PyObject *self, PyObject *noargs) {
    pthread_mutex_lock(&lock);
    PyObject *state = Py_BuildValue("{s:i,s:O,s:K}", "fuse_fd", hooked_fd, "kernel_offers",
                                    kernel_offers ? Py_True : Py_False, "foreign_xattrs_answered",
                                    (unsigned long long)foreign_xattrs_answered);
    pthread_mutex_unlock(&lock);
    return state;
}

static PyObject *py_attach(PyObject *self, PyObject *args) {
    unsigned long long fh;
    int backing_id;
    if (!PyArg_ParseTuple(args, "Ki", &fh, &backing_id))
        return NULL;
    pthread_mutex_lock(&lock);
    int full = n_attached >= MAX_PENDING;
    if (!full) {
        attached[n_attached].fh = fh;
        attached[n_attached].backing_id = backing_id;
        n_attached++;
    }
    pthread_mutex_unlock(&lock);
    if (full) {
        PyErr_SetString(PyExc_RuntimeError, "too many opens awaiting their reply");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_enable_fallocate(PyObject *self, PyObject *args) {
    Py_buffer token;
    if (!PyArg_ParseTuple(args, "y*", &token))
        return NULL;
    if (token.len != FALLOCATE_TOKEN_SIZE) {
        PyBuffer_Release(&token);
        PyErr_SetString(PyExc_ValueError, "the fallocate token must be 16 bytes");
        return NULL;
    }
    pthread_mutex_lock(&lock);
    memcpy(fallocate_token, token.buf, FALLOCATE_TOKEN_SIZE);
    fallocate_enabled = 1;
    pthread_mutex_unlock(&lock);
    PyBuffer_Release(&token);
    Py_RETURN_NONE;
}

static PyObject *py_answer_foreign_xattrs(PyObject *self, PyObject *noargs) {
    pthread_mutex_lock(&lock);
    foreign_xattrs_enabled = 1;
    pthread_mutex_unlock(&lock);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"request", py_request, METH_VARARGS,
     "request(max_stack_depth, nosec): at INIT ask for passthrough (depth 0: do not) and HANDLE_KILLPRIV_V2."},
    {"state", py_state, METH_NOARGS, "state() -> {fuse_fd, kernel_offers, foreign_xattrs_answered}."},
    {"attach", py_attach, METH_VARARGS, "attach(fh, backing_id): the reply to this open passes through."},
    {"enable_fallocate", py_enable_fallocate, METH_VARARGS,
     "enable_fallocate(token): FALLOCATE requests reach setxattr as 'burstfs.fallocate' (token + request)."},
    {"answer_foreign_xattrs", py_answer_foreign_xattrs, METH_NOARGS,
     "answer_foreign_xattrs(): GETXATTR of a name outside user.* is answered ENODATA by the read hook."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_passthrough", NULL, -1, methods};

PyMODINIT_FUNC PyInit__passthrough(void) { return PyModule_Create(&module); }
