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
 *
 * json_take_token_ids: a /generate body's `input_ids`, read from its JSON text straight into an array('I'),
 * and the rest of the body handed back for a JSON decoder. A decoder makes a Python int of every id (some 170
 * instructions an id), which the router then only checks and packs again; this reads the digits once, into 4
 * bytes an id, and packed_uint32 packs them from there.
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

/* The packed field around `length` bytes of varints at buf + head_room (see packed_uint32): the tag and the
 * length (and the outer field's) written just before them, the whole moved to the front. */
static PyObject *finish_packed(PyObject *out, Py_ssize_t head_room, Py_ssize_t length, unsigned long field,
                               unsigned long outer) {
    uint8_t *buf = (uint8_t *)PyBytes_AS_STRING(out);
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
    memmove(buf + head_len, buf + head_room, (size_t)length);
    if (_PyBytes_Resize(&out, head_len + length) < 0) {
        return NULL;
    }
    return out;
}

/* An array('I') (or any buffer of native 4-byte unsigned ints): every value is in range by its type. */
static int uint32_buffer(PyObject *values, Py_buffer *view) {
    if (!PyObject_CheckBuffer(values) || PyObject_GetBuffer(values, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (view->itemsize == 4 && view->format != NULL && strcmp(view->format, "I") == 0) {
        return 1;
    }
    PyBuffer_Release(view);
    return 0;
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
    Py_buffer view;
    int is_list = PyList_Check(values);
    if (!is_list && !uint32_buffer(values, &view)) {
        PyErr_Format(PyExc_TypeError, "values must be a list or an array('I'), not %.100s",
                     Py_TYPE(values)->tp_name);
        return NULL;
    }
    Py_ssize_t n = is_list ? PyList_GET_SIZE(values) : view.len / 4;
    const Py_ssize_t head_room = 4 * MAX_VARINT; /* the outer field's tag and length, then the inner's */
    if (n > (PY_SSIZE_T_MAX - head_room) / MAX_UINT32_VARINT) {
        if (!is_list) {
            PyBuffer_Release(&view);
        }
        return PyErr_NoMemory();
    }
    /* The payload goes after room for the tag and the length; both are then written just before it. */
    PyObject *out = PyBytes_FromStringAndSize(NULL, head_room + MAX_UINT32_VARINT * n);
    if (out == NULL) {
        if (!is_list) {
            PyBuffer_Release(&view);
        }
        return NULL;
    }
    uint8_t *payload = (uint8_t *)PyBytes_AS_STRING(out) + head_room;
    Py_ssize_t length = 0;
    if (!is_list) {
        const uint8_t *src = (const uint8_t *)view.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t value;
            memcpy(&value, src + 4 * i, 4);
            length += put_varint(payload + length, value);
        }
        PyBuffer_Release(&view);
        return finish_packed(out, head_room, length, field, outer);
    }
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
    return finish_packed(out, head_room, length, field, outer);
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

PyDoc_STRVAR(json_take_token_ids_doc,
             "json_take_token_ids(data, key, /) -> tuple[array('I'), bytes] | None\n\n"
             "The token ids of the field `key` (str) of the JSON object `data` (bytes), taken out: the ids as\n"
             "an array('I'), and `data` with that field's value written as []. Only where the value is a\n"
             "non-empty array of integer literals in [0, 2**32) with JSON's syntax (no sign, fraction, exponent\n"
             "or leading zero), the object has that key once and no key written with an escape, and its structure\n"
             "can be followed (brackets, strings, commas). The rest is not checked: a JSON decoder reads it.\n"
             "None for anything else.");

static PyObject *array_type; /* array.array, imported on first use */
_Static_assert(sizeof(unsigned int) == 4, "array('I') holds 4-byte ids");

static inline int json_space(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* The scanners below read a bytes object's text, which CPython ends with a NUL: a byte that none of their tests
 * accepts, so loops that stop at a byte they do not want need no bound check of their own. */
static inline const uint8_t *skip_space(const uint8_t *p) {
    while (json_space(*p)) {
        p++;
    }
    return p;
}

/* Past the string that opens at p (a '"'), or NULL where it does not end. Escapes are skipped, not checked. */
static const uint8_t *skip_string(const uint8_t *p, const uint8_t *end) {
    for (p++; p < end; p++) {
        if (*p == '\\') {
            p++;
        } else if (*p == '"') {
            return p + 1;
        }
    }
    return NULL;
}

/* Past the value that starts at p: a string, an array or object (its brackets counted outside strings), or
 * the run of bytes of a number or literal. NULL where it does not end. */
static const uint8_t *skip_value(const uint8_t *p, const uint8_t *end) {
    if (*p == '"') {
        return skip_string(p, end);
    }
    Py_ssize_t depth = 0;
    while (p < end) {
        uint8_t c = *p;
        if (c == '"') {
            if ((p = skip_string(p, end)) == NULL) {
                return NULL;
            }
            continue;
        }
        if (c == '[' || c == '{') {
            depth++;
        } else if (c == ']' || c == '}') {
            if (depth == 0) {
                return p; /* a number or literal, closed by its container */
            }
            if (--depth == 0) {
                return p + 1;
            }
        } else if (depth == 0 && (c == ',' || json_space(c))) {
            return p;
        }
        p++;
    }
    return depth == 0 ? p : NULL;
}

/* The ids of the array that opens at p, written to out (room for one id per two bytes of the text left, and
 * one) as 4 bytes each: past the array, with *count set, or NULL where it is anything but a non-empty array of
 * ids. */
static const uint8_t *read_ids(const uint8_t *p, uint8_t *out, Py_ssize_t *count) {
    if (*p++ != '[') {
        return NULL;
    }
    Py_ssize_t n = 0;
    for (;;) {
        p = skip_space(p);
        const uint8_t *first = p;
        uint64_t value = 0;
        unsigned digit;
        while ((digit = (unsigned)*p - '0') <= 9) { /* a longer run than uint64 holds is refused below */
            value = value * 10 + digit;
            p++;
        }
        Py_ssize_t digits = p - first;
        /* none (an empty array, a trailing comma, a sign...), a leading zero (not JSON), or out of range */
        if (digits == 0 || (*first == '0' && digits > 1) || digits > 10 || value > 0xFFFFFFFFULL) {
            return NULL;
        }
        uint32_t id = (uint32_t)value;
        memcpy(out + 4 * n++, &id, 4);
        p = skip_space(p);
        if (*p == ']') {
            *count = n;
            return p + 1;
        }
        if (*p++ != ',') { /* a fraction or an exponent (a float), the text's end, or not JSON */
            return NULL;
        }
    }
}

/* Reads the object that `data` (to end) holds, to its end: the ids of `key`'s value into a new bytes object
 * *ids (4 bytes an id; see read_ids), their count into *count, and that value's span into *value and
 * *value_end. 1 when taken; 0 where the object cannot be followed, lacks the key, has it twice, has a key
 * written with an escape (which could spell it), or where the key's value is not ids; -1 with an exception
 * set where *ids could not be made. Whatever it returns, *ids is the caller's to release (NULL or not). */
static int take_field(const uint8_t *p, const uint8_t *end, const char *key, Py_ssize_t key_len, PyObject **ids,
                      Py_ssize_t *count, const uint8_t **value, const uint8_t **value_end) {
    *value = NULL;
    p = skip_space(p);
    if (*p != '{') {
        return 0;
    }
    p = skip_space(p + 1);
    for (;;) {
        if (*p != '"') { /* an empty object too */
            return 0;
        }
        const uint8_t *name = p + 1, *past = skip_string(p, end);
        if (past == NULL || memchr(name, '\\', (size_t)(past - 1 - name)) != NULL) {
            return 0;
        }
        p = skip_space(past);
        if (*p != ':') {
            return 0;
        }
        p = skip_space(p + 1);
        if (past - 1 - name == key_len && memcmp(name, key, (size_t)key_len) == 0) {
            if (*value != NULL) {
                return 0;
            }
            /* Room for the most ids the text left can hold: every id but the last takes a digit and a comma. */
            if ((*ids = PyBytes_FromStringAndSize(NULL, 4 * ((end - p) / 2 + 1))) == NULL) {
                return -1;
            }
            *value = p;
            if ((p = *value_end = read_ids(p, (uint8_t *)PyBytes_AS_STRING(*ids), count)) == NULL) {
                return 0;
            }
        } else if ((p = skip_value(p, end)) == NULL) {
            return 0;
        }
        p = skip_space(p);
        if (*p != ',') {
            return *p == '}' && skip_space(p + 1) == end && *value != NULL;
        }
        p = skip_space(p + 1);
    }
}

static PyObject *json_take_token_ids(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "json_take_token_ids() takes data (bytes) and a key (str)");
        return NULL;
    }
    if (array_type == NULL) {
        PyObject *array_module = PyImport_ImportModule("array");
        if (array_module == NULL) {
            return NULL;
        }
        array_type = PyObject_GetAttrString(array_module, "array");
        Py_DECREF(array_module);
        if (array_type == NULL) {
            return NULL;
        }
    }
    Py_ssize_t key_len;
    const char *key = PyUnicode_AsUTF8AndSize(args[1], &key_len); /* an ASCII str's own bytes: no copy */
    if (key == NULL) {
        return NULL;
    }
    const uint8_t *data = (const uint8_t *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t size = PyBytes_GET_SIZE(args[0]);
    PyObject *ids = NULL;
    Py_ssize_t count = 0;
    const uint8_t *start = NULL, *stop = NULL;
    int taken = take_field(data, data + size, key, key_len, &ids, &count, &start, &stop);
    if (taken <= 0) {
        Py_XDECREF(ids);
        if (taken < 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    PyObject *result = NULL, *array = NULL;
    Py_ssize_t head = start - data, tail = data + size - stop;
    PyObject *rest = PyBytes_FromStringAndSize(NULL, head + 2 + tail);
    if (rest != NULL && _PyBytes_Resize(&ids, 4 * count) == 0) {
        char *out = PyBytes_AS_STRING(rest);
        memcpy(out, data, (size_t)head);
        memcpy(out + head, "[]", 2);
        memcpy(out + head + 2, stop, (size_t)tail);
        array = PyObject_CallFunction(array_type, "CO", 'I', ids);
        if (array != NULL) {
            result = PyTuple_Pack(2, array, rest);
        }
    }
    Py_XDECREF(array);
    Py_XDECREF(rest);
    Py_XDECREF(ids);
    return result;
}

static PyMethodDef wire_methods[] = {
    {"packed_uint32", (PyCFunction)(void (*)(void))packed_uint32, METH_FASTCALL, packed_uint32_doc},
    {"json_opens", json_opens, METH_O, json_opens_doc},
    {"json_take_token_ids", (PyCFunction)(void (*)(void))json_take_token_ids, METH_FASTCALL, json_take_token_ids_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef wire_module = {
    PyModuleDef_HEAD_INIT, "_wire", "Byte work of the request path, in C.", 0, wire_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__wire(void) { return PyModuleDef_Init(&wire_module); }
