# Types of the native module built from csrc/wire.c; keep the two in step.

def packed_uint32(field_number: int, values: list[int], outer_field: int = 0, /) -> bytes:
    """`values` (ints in [0, 2**32)) as the packed repeated uint32 field `field_number`: its tag, its length and
    the varints (nothing for no values), ready for a message's MergeFromString. With `outer_field`, that field
    wrapped as the only field of the submessage field `outer_field` (present even with no values), ready to
    append to the outer message's bytes. TypeError for an item that is not an int (a bool included),
    OverflowError for one out of range; either names the item's index."""

def json_opens(data: bytes, /) -> int:
    """How many '[' and '{' bytes `data` holds: the brackets a JSON text opens, at most (those inside strings
    count too). A text that opens n cannot nest deeper than n. TypeError for anything but bytes."""
