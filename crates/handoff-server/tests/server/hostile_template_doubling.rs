//! Story: a model file's chat template doubles a string 40 times. The
//! process used to abort when the string reached 4 GiB; now fuel pays for
//! data as well as instructions, so the string stops growing near the
//! budget's 64 MB and the server refuses the template at load, exit 2,
//! naming the limit. The model with a sound template serves.

use crate::hostile_templates::{DOUBLING, refused, the_fixture_still_serves};

#[test]
fn a_template_doubling_a_string_to_a_terabyte_is_refused_at_load() {
    let (status, stderr, took) = refused(DOUBLING);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("chat template exceeded its fuel budget of"),
        "{stderr}"
    );
    assert!(took.as_secs() < 30, "refused after {took:?}");
    the_fixture_still_serves();
}
