//! devlock's integration tests: real processes, signals, files and flock.
//!
//! One test binary with a harness of its own (libtest-mimic, `harness =
//! false` in Cargo.toml): libtest decides what runs at compile time, but
//! whether a test can test anything here (a tool installed, root) is known
//! only at run time. So every test below names what it needs; at start-up
//! a test whose needs are missing is reported as ignored, with the reason
//! in its line (`test [needs groff] generated::... ignored`), unless
//! `DEVLOCK_TEST_REQUIRE_TOOLS=1` (CI sets it), which makes it fail
//! instead. Everything else is libtest's command line: filters, `--exact`,
//! `--ignored`, `--test-threads`, `--list`.

// The tests play the terminal, the attacker and the signal sender with raw
// calls (openpty, kill, setsid); the crate's own `unsafe` is in src/sys/.
#![allow(unsafe_code)]
// A test binary: its modules' items are for each other.
#![allow(unreachable_pub)]

mod harness;

mod amd;
mod budgets;
mod containers;
mod core;
mod devices;
mod display;
#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "etcd")]
mod etcd_cluster;
#[cfg(feature = "etcd")]
mod etcd_ha;
#[cfg(feature = "etcd")]
mod etcd_server;
#[cfg(feature = "etcd")]
mod etcd_tls;
mod generated;
mod granularity;
mod kills;
mod manners;
mod nvml;
mod serve;
mod serve_scene;
mod shared_machine;
mod signals;
mod status;
mod torture;

use harness::Need::{BashCompletion, Cgroup, Root, Tool};
use harness::Test;

/// `test!(module::name, needs: [...])`, optionally `ignored: "why"` (run
/// only when asked for with `--ignored`).
macro_rules! test {
    ($module:ident :: $name:ident, $(ignored: $why:literal,)? needs: [$($need:expr),* $(,)?]) => {
        Test {
            name: concat!(stringify!($module), "::", stringify!($name)),
            run: $module::$name,
            needs: &[$($need),*],
            ignored: test!(@ignored $($why)?),
        }
    };
    (@ignored $why:literal) => { Some($why) };
    (@ignored) => { None };
}

/// Every test, with what it needs to test anything.
const TESTS: &[Test] = &[
    test!(budgets::three_budgets_share_a_device_and_a_fourth_is_refused_with_figures, needs: []),
    test!(budgets::the_whole_device_waits_for_budgets_and_budgets_wait_for_it, needs: [Tool("flock")]),
    test!(budgets::a_big_waiter_is_not_overtaken_by_later_small_ones, needs: []),
    test!(budgets::memory_outside_the_gate_is_counted, needs: []),
    test!(budgets::kill_9_of_a_holder_returns_its_budget_to_a_waiter, needs: []),
    test!(budgets::a_starting_job_is_the_only_one_starting, needs: []),
    test!(budgets::over_budget_is_said_once_and_strict_stops_the_job, needs: []),
    test!(budgets::any_mem_takes_the_first_device_with_room, needs: []),
    test!(budgets::the_job_learns_its_budget, needs: []),
    test!(budgets::status_with_budgets_fits_the_terminal_and_keeps_one_record_a_line, needs: []),
    test!(budgets::every_failure_is_one_line_with_its_code, needs: []),
    test!(budgets::a_budget_outlives_its_killed_devlock_while_its_command_runs, needs: []),
    test!(budgets::budgets_of_another_user_count_and_are_counted, needs: [Root, Tool("setpriv")]),
    test!(budgets::a_forged_budget_cannot_claim_another_holders_job, needs: []),
    test!(budgets::a_lock_on_a_started_budgets_ticket_is_shown_as_a_place_of_its_own, needs: []),
    test!(budgets::a_starting_job_stopped_by_ctrl_z_lets_the_next_budget_start, needs: [Tool("bash")]),
    test!(containers::a_lock_dir_shared_with_a_container_is_one_gate_named_on_both_sides, needs: [Root, Tool("unshare")]),
    test!(containers::nvml_host_pids_are_named_with_their_container_and_never_guessed_inside_one, needs: [Root, Tool("unshare"), Tool("nsenter"), Tool("cc")]),
    test!(amd::status_and_require_idle_through_amd_smi, needs: []),
    test!(amd::a_hanging_amd_smi_is_killed_at_the_timeout, needs: []),
    test!(amd::gpus_on_an_amd_machine_are_given_with_the_rocm_variables, needs: []),
    test!(core::many_processes_never_overlap_in_a_read_modify_write, needs: []),
    test!(core::flock_holder_blocks_devlock_and_is_named, needs: []),
    test!(core::devlock_holder_blocks_flock, needs: []),
    test!(core::exit_status_is_passed_on, needs: []),
    test!(core::command_learns_what_it_holds, needs: []),
    test!(core::sigterm_reaches_the_command_once_and_the_next_waits_for_cleanup, needs: []),
    test!(core::sigint_reaches_the_command_once_and_the_next_waits_for_cleanup, needs: []),
    test!(core::sighup_and_sigquit_are_passed_on, needs: []),
    test!(core::terminal_ctrl_c_is_not_delivered_twice, needs: []),
    test!(core::a_command_whose_devlock_and_guard_are_killed_holds_the_lock_on, needs: []),
    test!(core::nested_take_passes_through_instead_of_deadlocking, needs: []),
    test!(core::a_copied_environment_is_not_mistaken_for_holding, needs: []),
    test!(core::planted_symlink_and_fifo_are_refused_and_a_hard_link_is_never_written, needs: []),
    test!(core::a_symlinked_scratch_directory_is_refused, needs: []),
    test!(core::lock_files_and_directory_are_usable_by_everyone_whatever_the_umask, needs: []),
    test!(core::bad_input_is_refused_before_any_file_is_touched, needs: []),
    test!(core::an_unusable_directory_is_one_clear_line, needs: []),
    test!(core::no_wait_and_timeout_fail_with_the_conflict_code_and_name_the_holder, needs: []),
    test!(core::a_waiter_starts_once_the_holder_ends_and_says_so, needs: []),
    test!(core::a_replaced_lock_file_is_noticed, needs: []),
    test!(core::a_nested_take_whose_parent_closed_the_lock_says_why_it_waits, needs: []),
    test!(core::an_exclusive_take_inside_a_shared_hold_fails_instead_of_waiting_for_itself, needs: []),
    test!(core::an_ignored_sigchld_or_closed_stdio_from_the_parent_does_no_harm, needs: []),
    test!(core::signals_the_caller_ignored_stay_ignored_for_the_command, needs: []),
    test!(core::the_binary_does_not_load_libgcc_s, needs: [Tool("readelf")]),
    #[cfg(not(feature = "etcd"))]
    test!(core::etcd_without_the_feature_says_how_to_get_it, needs: []),
    test!(core::lease_flags_without_etcd_are_usage_errors, needs: []),
    test!(devices::status_shows_each_gpu_and_who_is_inside_the_gate, needs: []),
    test!(devices::unknown_fields_stay_unknown, needs: []),
    test!(devices::idle_gpus_list_no_processes, needs: []),
    test!(devices::a_failing_probe_makes_devices_unknown_not_free, needs: []),
    test!(devices::a_hanging_probe_is_killed_at_the_timeout, needs: []),
    test!(devices::without_nvidia_smi_there_is_quietly_no_device_information, needs: []),
    test!(devices::require_idle_refuses_a_gpu_with_work_outside_the_gate, needs: []),
    test!(devices::require_idle_passes_an_idle_gpu_and_small_users_under_the_threshold, needs: []),
    test!(devices::require_idle_fails_when_the_gpu_cannot_be_checked, needs: []),
    test!(devices::work_inside_the_gate_does_not_count_against_idle, needs: []),
    test!(devices::acquiring_without_require_idle_never_runs_the_probe, needs: []),
    test!(devices::the_callers_cuda_visible_devices_is_respected, needs: []),
    test!(devices::several_gpus_are_exported_in_numeric_order, needs: []),
    test!(devices::indices_in_cuda_visible_devices_never_run_the_probe, needs: []),
    test!(devices::a_nested_devlock_stays_inside_the_gpus_its_job_was_given, needs: []),
    test!(devices::require_idle_with_any_takes_the_first_candidate_that_is_free_and_idle, needs: []),
    test!(nvml::status_through_nvml_names_the_source_and_who_is_inside_the_gate, needs: [Tool("cc")]),
    test!(nvml::a_hung_nvml_call_never_hangs_devlock, needs: [Tool("cc")]),
    test!(nvml::the_systems_nvml_is_found_as_the_loader_finds_it_and_a_named_nvidia_smi_wins, needs: [Tool("cc")]),
    test!(nvml::nvidia_smi_answers_when_nvml_is_off_or_fails, needs: [Tool("cc")]),
    test!(nvml::a_process_list_nvml_refuses_is_unknown_not_idle, needs: [Tool("cc")]),
    test!(nvml::mig_instances_are_devices_with_their_own_processes, needs: [Tool("cc")]),
    test!(nvml::an_instance_holds_its_gpu_shared_and_the_gpu_excludes_it, needs: [Tool("cc")]),
    test!(nvml::two_mig_instances_for_one_command_are_refused_with_the_reason, needs: []),
    test!(nvml::setup_gpus_declares_the_mig_instances, needs: [Root, Tool("cc")]),
    test!(display::the_live_line_fits_a_narrow_terminal_and_follows_a_resize, needs: []),
    test!(display::devlocks_sharing_a_terminal_say_one_line_each_at_the_start_and_the_end, needs: []),
    test!(display::a_waiter_in_the_background_never_draws_over_the_prompt, needs: []),
    test!(display::every_line_in_a_log_names_the_waiters_step, needs: []),
    test!(display::back_in_line_after_ctrl_z_follows_the_rules_of_the_waiting_lines, needs: []),
    test!(display::back_in_line_fits_a_narrow_terminal, needs: [Tool("bash")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_holders_exclude_each_other, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_waiters_are_served_in_arrival_order, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_busy_names_the_holder_and_leaves_no_trace, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_kill_9_of_a_holder_kills_its_command_and_frees_the_lock_after_the_ttl, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_a_group_sigkill_ends_the_whole_job, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_holder_cut_off_stops_its_work_before_the_next_one_starts, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_a_stuck_stderr_does_not_delay_the_stop, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_what_the_command_leaves_running_keeps_the_lock, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_a_revoked_lease_stops_the_command_at_once, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_a_waiter_whose_key_is_removed_does_not_run, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_waiters_ride_out_an_etcd_restart, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_shared_holders_run_together_and_a_waiting_writer_goes_first, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_frozen_server_stops_the_command_and_the_lock_frees_after_thaw, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_nested_take_passes_through, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_signals_while_waiting_leave_the_line_and_reach_the_command_while_holding, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_bad_urls_and_dead_endpoints_fail_in_one_line, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_refused_credentials_fail_in_one_line_and_leave_nothing, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_a_key_removed_after_a_compaction_still_stops_the_holder, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_leftovers_that_ignore_sigterm_are_killed_after_the_grace, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd::etcd_flags_it_cannot_honour_are_usage_errors, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd_ha::etcd_cluster_with_one_member_down_serves_every_take_wait_and_release, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd_ha::etcd_cluster_leader_killed_during_holds_and_waits_keeps_exclusion_and_order, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd_ha::etcd_cluster_leader_partitioned_during_holds_and_waits_keeps_exclusion_and_order, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd_ha::etcd_cluster_contenders_in_every_endpoint_order_exclude_each_other, needs: [Tool("etcd"), Tool("etcdctl")]),
    #[cfg(feature = "etcd")]
    test!(etcd_ha::etcd_fencing_tokens_grow_with_every_holder_and_stop_a_stale_writer, needs: [Tool("etcd"), Tool("etcdctl"), Tool("python3")]),
    #[cfg(feature = "etcd")]
    test!(etcd_tls::etcd_tls_checks_the_servers_certificate_and_carries_a_password, needs: [Tool("etcd"), Tool("etcdctl"), Tool("openssl")]),
    #[cfg(feature = "etcd")]
    test!(etcd_tls::etcd_tls_client_certificates_are_checked_here_and_by_etcd, needs: [Tool("etcd"), Tool("etcdctl"), Tool("openssl")]),
    test!(generated::generated_files_are_up_to_date, needs: []),
    test!(generated::generated_output_is_deterministic, needs: []),
    test!(generated::man_page_has_every_section_and_exit_code, needs: []),
    test!(generated::readme_exit_table_lists_every_exit_code, needs: []),
    test!(generated::install_commands_build_what_was_tested, needs: []),
    test!(generated::readme_try_without_a_gpu_runs_as_pasted, needs: [Tool("bash")]),
    test!(generated::man_pages_render_without_warnings, needs: [Tool("groff"), Tool("man")]),
    test!(generated::bash_loads_the_completion_script, needs: [Tool("bash")]),
    test!(generated::bash_completes_resource_names_from_the_scratch_directory, needs: [Tool("bash"), BashCompletion]),
    test!(generated::zsh_and_fish_accept_their_completions, needs: [Tool("zsh"), Tool("fish")]),
    test!(generated::zsh_completes_the_command_after_the_double_dash, needs: [Tool("zsh")]),
    test!(granularity::a_whole_group_excludes_its_members_and_members_share_the_box, needs: []),
    test!(granularity::opposite_orders_never_deadlock, needs: []),
    test!(granularity::no_wait_and_timeout_release_what_they_took, needs: []),
    test!(granularity::any_takes_a_free_member_and_tells_the_command, needs: []),
    test!(granularity::any_waits_for_the_first_to_come_free_in_arrival_order, needs: []),
    test!(granularity::shared_holders_run_together_and_an_exclusive_one_alone, needs: []),
    test!(granularity::a_waiting_writer_is_not_starved_by_new_readers, needs: []),
    test!(granularity::a_waiter_is_not_overtaken_by_a_tight_retry_loop, needs: []),
    test!(granularity::a_waiter_killed_in_line_never_blocks_the_line, needs: []),
    test!(granularity::slots_admit_up_to_n_and_everyone_must_agree_on_n, needs: []),
    test!(granularity::bad_combinations_are_usage_errors, needs: []),
    test!(granularity::any_takes_a_members_group_only_with_the_member_it_picks, needs: []),
    test!(granularity::any_count_and_ordered_jobs_do_not_deadlock, needs: []),
    test!(kills::a_group_sigkill_ends_the_job_in_a_group_of_its_own, needs: []),
    test!(kills::kill_9_of_devlock_alone_ends_the_job, needs: []),
    test!(kills::a_session_leaders_group_or_session_sigkill_ends_the_job, needs: []),
    test!(kills::timeout_kill_after_ends_the_job, needs: [Tool("timeout")]),
    test!(kills::python_killpg_after_start_new_session_ends_the_job, needs: [Tool("python3")]),
    test!(kills::make_j_cancelled_by_a_group_sigkill_ends_every_job, needs: [Tool("make")]),
    test!(kills::in_a_terminals_shared_group_a_kill_ends_the_job_and_spares_the_others, needs: []),
    test!(kills::a_process_the_command_detached_keeps_the_lock_after_the_kill, needs: [Tool("setsid")]),
    test!(kills::systemd_stop_with_either_kill_mode_ends_the_job, needs: [Root, Cgroup]),
    test!(kills::a_group_sigkill_at_any_moment_of_the_start_leaves_nothing, needs: []),
    test!(manners::a_bare_number_is_seconds_wherever_a_duration_is_taken, needs: []),
    test!(manners::every_usage_error_names_the_flag_and_the_fix, needs: []),
    test!(manners::an_empty_devlock_variable_counts_as_unset, needs: []),
    test!(manners::devlock_dir_is_exported_absolute_and_byte_exact, needs: []),
    test!(manners::quiet_keeps_a_busy_lock_to_the_exit_status_but_says_errors, needs: []),
    test!(manners::a_missing_or_unrunnable_command_fails_before_joining_the_line, needs: []),
    test!(manners::any_failures_and_waits_name_every_holder, needs: []),
    test!(manners::a_wait_behind_a_queued_whole_group_request_names_it, needs: []),
    test!(manners::a_holder_whose_devlock_is_gone_is_called_inherited_in_messages_and_in_the_group_row, needs: []),
    test!(manners::a_group_row_borrows_only_a_label_its_member_backs, needs: []),
    test!(serve::status_json_is_status_json_without_command_lines, needs: [Tool("cc")]),
    test!(serve::metrics_pass_promtool_and_carry_the_values, needs: [Tool("cc"), Tool("promtool")]),
    test!(serve::the_page_in_a_headless_browser_shows_the_holder_and_the_line, needs: [Tool("cc"), Tool("chromium-headless-shell")]),
    test!(serve::requests_are_bounded_and_only_get_and_head_are_answered, needs: []),
    test!(serve::more_connections_than_the_limit_are_told_503_and_then_served, needs: []),
    test!(serve::the_shipped_unit_serves_as_an_unprivileged_user_what_status_shows_that_user, needs: [Root, Tool("setpriv"), Tool("cc")]),
    test!(serve::listen_and_usage_errors_are_one_line, needs: []),
    test!(serve::every_metric_family_is_documented_and_every_documented_one_served, needs: []),
    test!(serve::the_prometheus_examples_pass_promtool, needs: [Tool("promtool")]),
    test!(serve_scene::doc_screenshot, ignored: "writes doc/serve.png", needs: [Root, Tool("setpriv"), Tool("unshare"), Tool("faketime"), Tool("cc"), Tool("chromium-headless-shell")]),
    test!(shared_machine::a_holder_whose_lock_file_another_user_renames_says_so_and_status_shows_it, needs: [Root, Tool("setpriv")]),
    test!(shared_machine::a_squatted_directory_and_lock_file_are_named_then_taken_over_by_setup, needs: [Root, Tool("setpriv")]),
    test!(shared_machine::setup_refuses_without_root_and_makes_group_only_gpu_locks, needs: [Root, Tool("setpriv")]),
    test!(shared_machine::the_shipped_tmpfiles_snippet_makes_a_managed_directory, needs: [Root, Tool("setpriv"), Tool("systemd-tmpfiles")]),
    test!(shared_machine::a_hard_link_to_a_lock_file_disables_nothing, needs: [Root, Tool("setpriv")]),
    test!(shared_machine::a_corrupt_queue_header_changes_nothing, needs: [Root, Tool("setpriv")]),
    test!(shared_machine::files_of_the_wrong_type_are_one_line_errors_and_setup_swaps_them_out, needs: [Root, Tool("setpriv")]),
    test!(shared_machine::strangers_locks_on_the_queue_are_named_and_waits_stay_bounded, needs: [Root, Tool("setpriv")]),
    test!(shared_machine::forged_and_replayed_records_and_registrations_are_not_believed, needs: [Root, Tool("setpriv")]),
    test!(shared_machine::records_keep_no_command_line_and_release_clears_the_label, needs: [Root, Tool("setpriv")]),
    test!(shared_machine::ctrl_z_in_line_gives_up_the_place_and_fg_rejoins_at_the_back, needs: [Root, Tool("setpriv"), Tool("script"), Tool("bash")]),
    test!(shared_machine::sigstop_of_a_waiter_or_a_holder_shows_as_stopped, needs: [Root, Tool("setpriv")]),
    test!(shared_machine::pid_reuse_after_kill_9_of_a_holder_blames_nobody_unrelated, needs: [Root, Tool("setpriv")]),
    test!(shared_machine::a_gpu_has_one_name_in_run_status_and_setup, needs: []),
    test!(shared_machine::dir_dot_with_a_cargo_lock_loses_no_data, needs: []),
    test!(shared_machine::a_private_lock_file_held_by_plain_flock_shows_as_held, needs: [Root, Tool("setpriv"), Tool("flock")]),
    test!(shared_machine::status_inside_a_pid_namespace_says_held_by_unknown, needs: [Root, Tool("setpriv"), Tool("unshare")]),
    test!(signals::a_signal_sent_to_devlocks_pid_reaches_the_command_once, needs: []),
    test!(signals::a_signal_sent_to_devlocks_process_group_reaches_the_command_once, needs: []),
    test!(signals::timeout_reaches_the_command_once, needs: [Tool("timeout")]),
    test!(signals::ctrl_c_at_a_terminal_reaches_the_command_once, needs: []),
    test!(signals::ctrl_c_under_make_j_reaches_each_command_once, needs: [Tool("make")]),
    test!(signals::a_command_reading_the_terminal_works_in_the_foreground, needs: []),
    test!(signals::ctrl_z_stops_the_job_and_fg_gives_the_command_the_terminal_again, needs: [Tool("bash")]),
    test!(signals::a_ctrl_z_just_before_the_command_starts_stops_the_whole_job, needs: [Root, Tool("setpriv"), Tool("bash"), Tool("mkdir")]),
    test!(signals::a_warning_while_the_command_has_the_terminal_does_not_stop_the_job, needs: [Tool("bash")]),
    test!(signals::a_signal_the_command_sends_devlock_is_not_passed_back, needs: []),
    test!(signals::signal_counter, ignored: "the command the signal tests run", needs: []),
    test!(status::status_names_the_holder_in_both_forms, needs: []),
    test!(status::waiters_show_in_arrival_order_and_vanish_when_killed, needs: []),
    test!(status::a_killed_holder_leaves_nothing_behind, needs: []),
    test!(status::plain_flock_holder_shows_as_the_pid_the_kernel_names, needs: []),
    test!(status::a_record_of_a_dead_or_recycled_pid_is_stale_never_the_holder, needs: []),
    test!(status::escapes_and_garbage_in_records_never_reach_the_terminal, needs: []),
    test!(status::a_waiter_reports_every_interval_when_not_on_a_terminal, needs: []),
    test!(status::a_long_wait_sleeps_between_reports, needs: []),
    test!(status::quiet_waiters_print_nothing, needs: []),
    test!(status::the_live_line_is_cleared_before_the_command_owns_the_terminal, needs: []),
    test!(status::locks_of_one_user_are_seen_and_shared_by_another, needs: []),
    test!(status::colour_only_on_a_terminal_and_never_with_no_color, needs: []),
    test!(status::the_table_shows_locks_in_use_and_counts_the_idle_ones, needs: []),
    test!(status::the_table_never_counts_a_lock_it_cannot_call_free_among_the_idle, needs: []),
    test!(torture::chaos_never_admits_two_holders, needs: []),
    test!(torture::torn_records_are_never_accepted, needs: []),
    test!(torture::inode_split_never_admits_two_holders, needs: []),
    test!(torture::signals_to_supervisors_under_load, needs: []),
];

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let conclusion = libtest_mimic::run(&args, harness::trials(TESTS));
    #[cfg(feature = "etcd")]
    etcd_cluster::stop_shared();
    conclusion.exit();
}
