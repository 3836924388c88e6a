/* psrl._wire: the per-byte and per-id work on a request's path, in C.
 *
 * packed_uint32: a Generate request carries its prompt as `repeated uint32 input_ids`, packed. Given a
 * Python list, protobuf's Python API converts the ids one at a time through its generic path (some 200
 * instructions an id, more than the rest of the request's building), and the router checked them once
 * before that. Here each id is checked and written as a varint directly.
 *
 * json_opens: every JSON body is bounded in depth before it is decoded (psrl.serving.json_body), and a
 * body that opens few brackets cannot nest deep. bytes.count reads a byte at a time, twice for the two
 * brackets (some 10 instructions a byte); this loop counts both in one pass, which the compiler vectorizes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_VARINT 10 /* bytes of a 64-bit varint */
#define MAX_UINT32_VARINT 5
#define MAX_FIELD_NUMBER 536870911UL /* 2**29 - 1 */

static Py_ssize_t put_varint(uint8_t *out, uint64_t value) {
    Py_ssize_t n = 0;
    while (value >= 0x80) {
        out[n++] = (uint8_t)(value | 0x80);
        value >>= 7;
    }
    out[n++] = (uint8_t)value;
    return n;
}

/* An int of one digit (0 <= value < 2**30, every real token id) read in place: PyLong_AsUnsignedLong is a
 * call and a few checks an id. Anything else (negative, larger) returns 0 and takes the general path. */
static inline int small_int(PyObject *item, unsigned long *value) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)item);
        if (v >= 0) {
            *value = (unsigned long)v;
            return 1;
        }
    }
    return 0;
#else
    Py_ssize_t size = Py_SIZE(item);
    if (size == 0 || size == 1) {
        *value = size ? (unsigned long)((PyLongObject *)item)->ob_digit[0] : 0UL;
        return 1;
    }
    return 0;
#endif
}

PyDoc_STRVAR(packed_uint32_doc,
             "packed_uint32(field_number, values, outer_field=0, /) -> bytes\n\n"
             "`values` (a list of int in [0, 2**32)) as the packed repeated uint32 field `field_number`:\n"
             "its tag, its length and the values as varints (nothing for no values), ready for a\n"
             "message's MergeFromString. With `outer_field`, that field wrapped as the only field of the\n"
             "submessage field `outer_field` (present even with no values), ready to append to the outer\n"
             "message's bytes. TypeError for an item that is not an int (a bool included), OverflowError\n"
             "for one out of range; either names the item's index.");

static int field_number(PyObject *arg, unsigned long *field) {
    *field = PyLong_AsUnsignedLong(arg);
    if (*field == (unsigned long)-1 && PyErr_Occurred()) {
        return 0;
    }
    if (*field < 1 || *field > MAX_FIELD_NUMBER) {
        PyErr_Format(PyExc_ValueError, "field number %lu is not in [1, 2**29)", *field);
        return 0;
    }
    return 1;
}

static PyObject *packed_uint32(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 && nargs != 3) {
        PyErr_Format(PyExc_TypeError, "packed_uint32() takes 2 or 3 arguments (%zd given)", nargs);
        return NULL;
    }
    unsigned long field, outer = 0;
    if (!field_number(args[0], &field) || (nargs == 3 && !field_number(args[2], &outer))) {
        return NULL;
    }
    PyObject *values = args[1];
    if (!PyList_Check(values)) {
        PyErr_Format(PyExc_TypeError, "values must be a list, not %.100s", Py_TYPE(values)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(values);
    const Py_ssize_t head_room = 4 * MAX_VARINT; /* the outer field's tag and length, then the inner's */
    if (n > (PY_SSIZE_T_MAX - head_room) / MAX_UINT32_VARINT) {
        return PyErr_NoMemory();
    }
    /* The payload goes after room for the tag and the length; both are then written just before it. */
    PyObject *out = PyBytes_FromStringAndSize(NULL, head_room + MAX_UINT32_VARINT * n);
    if (out == NULL) {
        return NULL;
    }
    uint8_t *buf = (uint8_t *)PyBytes_AS_STRING(out);
    uint8_t *payload = buf + head_room;
    Py_ssize_t length = 0;
    /* No Python code runs in this loop (an int's value is read directly), so the list cannot change under it. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(values, i);
        if (!PyLong_Check(item) || PyBool_Check(item)) {
            PyErr_Format(PyExc_TypeError, "item %zd is %.100s, not an integer", i, Py_TYPE(item)->tp_name);
            Py_DECREF(out);
            return NULL;
        }
        unsigned long value;
        if (!small_int(item, &value)) {
            value = PyLong_AsUnsignedLong(item);
            if ((value == (unsigned long)-1 && PyErr_Occurred()) || value > 0xFFFFFFFFUL) {
                PyErr_Clear();
                PyErr_Format(PyExc_OverflowError, "item %zd is not in [0, 2**32)", i);
                Py_DECREF(out);
                return NULL;
            }
        }
        length += put_varint(payload + length, value);
    }
    /* An empty packed field is not written at all, as protobuf writes it; its submessage still is. */
    uint8_t inner[2 * MAX_VARINT];
    Py_ssize_t inner_len = 0;
    if (length) {
        inner_len = put_varint(inner, ((uint64_t)field << 3) | 2); /* wire type 2: length-delimited */
        inner_len += put_varint(inner + inner_len, (uint64_t)length);
    }
    uint8_t head[4 * MAX_VARINT];
    Py_ssize_t head_len = 0;
    if (outer) {
        head_len = put_varint(head, ((uint64_t)outer << 3) | 2);
        head_len += put_varint(head + head_len, (uint64_t)(inner_len + length));
    }
    memcpy(head + head_len, inner, (size_t)inner_len);
    head_len += inner_len;
    memcpy(buf, head, (size_t)head_len);
    memmove(buf + head_len, payload, (size_t)length);
    if (_PyBytes_Resize(&out, head_len + length) < 0) {
        return NULL;
    }
    return out;
}

PyDoc_STRVAR(json_opens_doc,
             "json_opens(data, /) -> int\n\n"
             "How many '[' and '{' bytes `data` (bytes) holds: the brackets a JSON text opens, at most\n"
             "(those inside strings count too). A text that opens n cannot nest deeper than n.");

static PyObject *json_opens(PyObject *module, PyObject *data) {
    (void)module;
    if (!PyBytes_Check(data)) {
        PyErr_Format(PyExc_TypeError, "data must be bytes, not %.100s", Py_TYPE(data)->tp_name);
        return NULL;
    }
    const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    size_t count = 0;
    /* Blocks of 240 bytes (15 vectors of 16) count into a byte, which cannot overflow there: the compiler then
     * keeps a byte per lane (16 bytes a step) where a size_t count widened every byte to 8. */
    for (Py_ssize_t start = 0; start < n; start += 240) {
        Py_ssize_t stop = n - start < 240 ? n : start + 240;
        uint8_t block = 0;
        for (Py_ssize_t i = start; i < stop; i++) {
            block += (uint8_t)((p[i] == '[') | (p[i] == '{'));
        }
        count += block;
    }
    return PyLong_FromSize_t(count);
}

static PyMethodDef wire_methods[] = {
    {"packed_uint32", (PyCFunction)(void (*)(void))packed_uint32, METH_FASTCALL, packed_uint32_doc},
    {"json_opens", json_opens, METH_O, json_opens_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef wire_module = {
    PyModuleDef_HEAD_INIT, "_wire", "Byte work of the request path, in C.", 0, wire_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__wire(void) { return PyModuleDef_Init(&wire_module); }
