/**
 * jupyter-gpu-snapshot: snapshot a notebook's kernel (CUDA state included) and restore it.
 *
 * The toolbar button and the Kernel menu entries are declared in schema/plugin.json;
 * this file supplies the commands and widgets they name.
 */
import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, IToolbarWidgetRegistry } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Signal } from '@lumino/signaling';
import { SnapshotAPI } from './api';
import { SnapshotButton } from './button';
import { SnapshotController } from './controller';
import { pickSnapshot } from './dialog';
import { restoreIcon, snapshotIcon } from './icons';
import { ShutdownOffer } from './reboot';
import { SnapshotStatusItem } from './statusbar';

const PLUGIN_ID = 'jupyter-gpu-snapshot:plugin';

export namespace CommandIDs {
  export const save = 'gpu-snapshot:save';
  export const restore = 'gpu-snapshot:restore';
}

/** The toolbar item name used in schema/plugin.json. */
const TOOLBAR_ITEM = 'gpu-snapshot';

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'Snapshot a notebook kernel (CUDA state included) and restore it into the notebook.',
  autoStart: true,
  requires: [INotebookTracker, IToolbarWidgetRegistry],
  optional: [ICommandPalette, IStatusBar, ISettingRegistry],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    toolbarRegistry: IToolbarWidgetRegistry,
    palette: ICommandPalette | null,
    statusBar: IStatusBar | null,
    settingRegistry: ISettingRegistry | null
  ) => {
    const controller = new SnapshotController(new SnapshotAPI(), app.serviceManager);
    const current = (): NotebookPanel | null => tracker.currentWidget;

    app.commands.addCommand(CommandIDs.save, {
      label: 'Snapshot kernel',
      caption: () => controller.saveAvailability(current()).reason,
      icon: snapshotIcon,
      isEnabled: () => controller.saveAvailability(current()).enabled,
      execute: async () => {
        const panel = current();
        if (panel) {
          await controller.save(panel);
        }
      }
    });

    app.commands.addCommand(CommandIDs.restore, {
      label: 'Restore kernel from snapshot…',
      caption:
        "Pick a snapshot and restore it as this notebook's kernel; snapshots can be deleted there too",
      icon: restoreIcon,
      isEnabled: () => {
        const panel = current();
        return panel !== null && controller.activeJob(panel) === null;
      },
      execute: async () => {
        const panel = current();
        if (!panel) {
          return;
        }
        // A deleted snapshot may have been the one the status bar and the button report.
        const snapshot = await pickSnapshot(controller.api, panel.context.path, () => {
          const kernelId = controller.kernelId(panel);
          if (kernelId) {
            void controller.refresh(kernelId);
          }
        });
        if (snapshot && !panel.isDisposed) {
          await controller.restore(panel, snapshot);
        }
      }
    });

    const notify = () => {
      app.commands.notifyCommandChanged(CommandIDs.save);
      app.commands.notifyCommandChanged(CommandIDs.restore);
    };
    controller.changed.connect(notify);
    tracker.currentChanged.connect(notify);

    if (palette) {
      palette.addItem({ command: CommandIDs.save, category: 'Kernel' });
      palette.addItem({ command: CommandIDs.restore, category: 'Kernel' });
    }

    toolbarRegistry.addFactory<NotebookPanel>(
      'Notebook',
      TOOLBAR_ITEM,
      panel => new SnapshotButton(panel, controller)
    );

    if (statusBar) {
      const item = new SnapshotStatusItem(tracker, controller, () => {
        void app.commands.execute(CommandIDs.restore);
      });
      const activeStateChanged = new Signal<SnapshotStatusItem, void>(item);
      item.changed = () => activeStateChanged.emit();
      statusBar.registerStatusItem(PLUGIN_ID, {
        item,
        align: 'left',
        rank: 5,
        isActive: () => item.visible,
        activeStateChanged
      });
    }

    const offer = new ShutdownOffer(controller);
    let offerAfterShutdown = true;
    tracker.widgetAdded.connect((_, panel) => {
      if (offerAfterShutdown) {
        void offer.check(panel);
      }
    });
    if (settingRegistry) {
      void settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          const read = () => {
            offerAfterShutdown = settings.get('offerRestoreAfterShutdown')
              .composite as boolean;
          };
          read();
          settings.changed.connect(read);
        })
        .catch(reason => {
          console.error('jupyter-gpu-snapshot: cannot load settings', reason);
        });
    }
  }
};

export default plugin;
